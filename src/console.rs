//! Lines for the person at the terminal. A closed output (a pipe whose reader has
//! gone: `nanogpt train ... | head`) must never end a training run or turn into a
//! panic: the first failed write on a stream stops printing to it, and the run goes on
//! (`metrics.jsonl` and the checkpoints hold everything it would have printed). For
//! commands whose output is the product (`sample`), [`exit_if_closed`] ends the
//! command quietly instead, as other command-line tools do.

use std::fmt;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes one line to stdout (see [`outln!`](crate::outln)).
pub fn out_line(args: fmt::Arguments) {
    write_line(&mut io::stdout().lock(), &STDOUT_CLOSED, args)
}

/// Writes one line to stderr (see [`errln!`](crate::errln)).
pub fn err_line(args: fmt::Arguments) {
    write_line(&mut io::stderr().lock(), &STDERR_CLOSED, args)
}

fn write_line(out: &mut impl Write, closed: &AtomicBool, args: fmt::Arguments) {
    if closed.load(Ordering::Relaxed) {
        return;
    }
    if writeln!(out, "{args}").and_then(|()| out.flush()).is_err() {
        closed.store(true, Ordering::Relaxed);
    }
}

/// `result`, except that a pipe whose reader has gone ends the process at once with
/// status 0 and no message.
pub fn exit_if_closed<T>(result: io::Result<T>) -> io::Result<T> {
    match result {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => std::process::exit(0),
        other => other,
    }
}

/// `println!` that never panics: a closed stdout stops the printing, not the program.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => { $crate::console::out_line(format_args!($($arg)*)) };
}

/// `eprintln!` that never panics: a closed stderr stops the printing, not the program.
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => { $crate::console::err_line(format_args!($($arg)*)) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer whose reader has gone.
    struct Closed;

    impl Write for Closed {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_stream_stops_the_printing_without_a_panic() {
        let closed = AtomicBool::new(false);
        write_line(&mut Closed, &closed, format_args!("step {}", 1));
        assert!(closed.load(Ordering::Relaxed));
        let mut buf = Vec::new();
        write_line(&mut buf, &closed, format_args!("not written"));
        assert!(buf.is_empty(), "nothing more is written once closed");
        let open = AtomicBool::new(false);
        write_line(&mut buf, &open, format_args!("a {}", "line"));
        assert_eq!(buf, b"a line\n");
    }
}

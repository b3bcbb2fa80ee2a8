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

/// Writes the line whole, in one call: stderr is unbuffered, and `writeln!` would
/// write each piece of the format separately, so the lines of ranks sharing one
/// stream (every rank's stderr under `mpirun`) interleaved mid-line.
fn write_line(out: &mut impl Write, closed: &AtomicBool, args: fmt::Arguments) {
    if closed.load(Ordering::Relaxed) {
        return;
    }
    let line = format!("{args}\n");
    if out
        .write_all(line.as_bytes())
        .and_then(|()| out.flush())
        .is_err()
    {
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

    /// A writer that keeps each write call apart.
    #[derive(Default)]
    struct Calls(Vec<Vec<u8>>);

    impl Write for Calls {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.push(bytes.to_vec());
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_is_written_in_one_call() {
        // Several processes share stderr under mpirun: a line written in pieces
        // interleaves with the other ranks' lines.
        let mut calls = Calls::default();
        let open = AtomicBool::new(false);
        let (rank, host) = (1, "vm");
        write_line(
            &mut calls,
            &open,
            format_args!("error: rank {rank} of 2 (host {host}): x"),
        );
        assert_eq!(calls.0, [b"error: rank 1 of 2 (host vm): x\n".to_vec()]);
    }
}

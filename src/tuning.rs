//! The switches that exist for A/B measurements: each turns one optimisation off
//! (or, for two, forces a choice the program otherwise makes itself), to measure
//! what it saves or to test that it changes no bit. They are read from the
//! environment once per process, with the other variables, in [`env`](mod@env) ([`get`]),
//! and printed at the start of `train` and `bench` when any is set
//! ([`Tuning::changed`]). Users
//! leave them unset; `bench/*.sh` and tests/mpi.rs set them. With several ranks,
//! `mpirun -x NAME` forwards one.
//!
//! | variable | unset | set |
//! |---|---|---|
//! | `NANOGPT_RING_REDUCE=0` | ZeRO 1-3 reduce and gather on our rings | MPI's collectives (the memory plan follows) |
//! | `NANOGPT_BF16_PACKS=0` | bf16 linear weights packed once per refresh where a step reads them more than once | packed per product (same bits; the plan follows) |
//! | `NANOGPT_OVERLAP=0` | gradient reductions start during backward | each waited for at once |
//! | `NANOGPT_PROGRESS_THREAD=0\|1` | MPI progress thread when some ranks are on other hosts (and for ZeRO-3's collectives in flight) | off / on |
//! | `NANOGPT_AG_OVERLAP=0` | ZeRO-1/2 leave the weights' all-gathers in flight | one blocking gather after the update |
//! | `NANOGPT_EMBEDDINGS_FIRST=0\|1` | the embeddings' bucket reported first where the gather carries no more than it | last / first |
//! | `NANOGPT_ZERO3_KEEP=0` | ZeRO-3 keeps the buckets the next pass needs first | releases every bucket at once |
//! | `NANOGPT_ZERO3_PREFETCH=0` | ZeRO-3 gathers the next bucket while this one computes | waits for each collective at once |
//! | `NANOGPT_ZERO3_HUGE_PAGES=0` | large refilled buffers on transparent huge pages | 4 KiB pages |
//!
//! Choices that change what a run computes are config keys, recorded in its
//! checkpoint, not variables here (the bf16 kernel: `bf16_kernel`). The other
//! variables (about the machine or the launch, `serve`'s key, the test hooks) are
//! read there too. No other module reads a `NANOGPT_*` variable.

pub mod env;

/// The A/B switches of this process (see the module comment); `Default` is every
/// optimisation on and every choice the program's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// ZeRO 1-3 reduce gradients and gather weights with our rings
    /// (`NANOGPT_RING_REDUCE=0`: MPI's collectives).
    pub ring_reduce: bool,
    /// bf16: the linear weights may be packed once per refresh (`NANOGPT_BF16_PACKS=0`:
    /// per product).
    pub bf16_pack_linears: bool,
    /// Gradient reductions start during backward (`NANOGPT_OVERLAP=0`: waited for at
    /// once).
    pub overlap: bool,
    /// `NANOGPT_PROGRESS_THREAD=0|1`: the MPI progress thread forced off or on; None:
    /// the program's choice.
    pub progress_thread: Option<bool>,
    /// ZeRO-1/2 leave the weights' all-gathers in flight (`NANOGPT_AG_OVERLAP=0`: one
    /// blocking gather).
    pub ag_overlap: bool,
    /// `NANOGPT_EMBEDDINGS_FIRST=0|1`: the embeddings' bucket forced last or first;
    /// None: the program's choice.
    pub embeddings_first: Option<bool>,
    /// ZeRO-3 keeps whole the buckets the next pass needs first (`NANOGPT_ZERO3_KEEP=0`).
    pub zero3_keep: bool,
    /// ZeRO-3 prefetches the next bucket (`NANOGPT_ZERO3_PREFETCH=0`).
    pub zero3_prefetch: bool,
    /// Large refilled buffers asked onto huge pages (`NANOGPT_ZERO3_HUGE_PAGES=0`).
    pub huge_pages: bool,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            ring_reduce: true,
            bf16_pack_linears: true,
            overlap: true,
            progress_thread: None,
            ag_overlap: true,
            embeddings_first: None,
            zero3_keep: true,
            zero3_prefetch: true,
            huge_pages: true,
        }
    }
}

/// A variable and the field of [`Tuning`] it sets.
type Var<T> = (&'static str, fn(&mut Tuning) -> &mut T);

/// The variables of the on/off switches, each with its field.
const SWITCHES: [Var<bool>; 7] = [
    ("NANOGPT_RING_REDUCE", |t| &mut t.ring_reduce),
    ("NANOGPT_BF16_PACKS", |t| &mut t.bf16_pack_linears),
    ("NANOGPT_OVERLAP", |t| &mut t.overlap),
    ("NANOGPT_AG_OVERLAP", |t| &mut t.ag_overlap),
    ("NANOGPT_ZERO3_KEEP", |t| &mut t.zero3_keep),
    ("NANOGPT_ZERO3_PREFETCH", |t| &mut t.zero3_prefetch),
    ("NANOGPT_ZERO3_HUGE_PAGES", |t| &mut t.huge_pages),
];

/// The variables that force a choice either way, each with its field.
const FORCES: [Var<Option<bool>>; 2] = [
    ("NANOGPT_PROGRESS_THREAD", |t| &mut t.progress_thread),
    ("NANOGPT_EMBEDDINGS_FIRST", |t| &mut t.embeddings_first),
];

impl Tuning {
    /// The switches as `var` (a variable's value, if set) gives them: `0` turns a
    /// switch off, `0`/`1` force a choice; any other value leaves the default.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Tuning {
        let mut t = Tuning::default();
        for (name, field) in SWITCHES {
            if var(name).as_deref() == Some("0") {
                *field(&mut t) = false;
            }
        }
        for (name, field) in FORCES {
            *field(&mut t) = match var(name).as_deref() {
                Some("0") => Some(false),
                Some("1") => Some(true),
                _ => None,
            };
        }
        t
    }

    /// The switches set away from the default, as `NAME=VALUE`: what `train` and
    /// `bench` print at start-up.
    pub fn changed(&self) -> Vec<String> {
        let mut t = *self;
        let mut out = Vec::new();
        for (name, field) in SWITCHES {
            if !*field(&mut t) {
                out.push(format!("{name}=0"));
            }
        }
        for (name, field) in FORCES {
            if let Some(on) = *field(&mut t) {
                out.push(format!("{name}={}", u8::from(on)));
            }
        }
        out
    }
}

/// This process's switches, read from the environment on first use ([`env::get`]).
pub fn get() -> &'static Tuning {
    &env::get().switches
}

/// The line `train` and `bench` print when any switch is set, naming them.
pub fn announcement() -> Option<String> {
    let changed = get().changed();
    (!changed.is_empty()).then(|| format!("A/B switches set: {}", changed.join(" ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(vars: &[(&str, &str)]) -> Tuning {
        Tuning::from_vars(|name| {
            let hit = vars.iter().find(|(n, _)| *n == name);
            hit.map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn unset_is_the_default_and_only_zero_turns_a_switch_off() {
        assert_eq!(of(&[]), Tuning::default());
        assert!(of(&[]).changed().is_empty());
        let t = of(&[("NANOGPT_RING_REDUCE", "0"), ("NANOGPT_OVERLAP", "1")]);
        assert!(!t.ring_reduce && t.overlap);
        assert_eq!(t.changed(), ["NANOGPT_RING_REDUCE=0"]);
        for (name, _) in SWITCHES {
            let t = of(&[(name, "0")]);
            assert_eq!(t.changed(), [format!("{name}=0")], "{name}");
        }
    }

    #[test]
    fn forces_go_either_way() {
        let t = of(&[
            ("NANOGPT_PROGRESS_THREAD", "1"),
            ("NANOGPT_EMBEDDINGS_FIRST", "0"),
        ]);
        assert_eq!(
            (t.progress_thread, t.embeddings_first),
            (Some(true), Some(false))
        );
        assert_eq!(
            t.changed(),
            ["NANOGPT_PROGRESS_THREAD=1", "NANOGPT_EMBEDDINGS_FIRST=0"]
        );
        assert_eq!(
            of(&[("NANOGPT_EMBEDDINGS_FIRST", "yes")]).embeddings_first,
            None
        );
    }
}

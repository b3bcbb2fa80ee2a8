//! The environment variables that are not A/B switches: about the machine, the
//! launch, `serve`'s key, and the hooks tests use; with them the A/B switches of
//! [`super::Tuning`]. Read once per process, here and nowhere else ([`get`]); the
//! code that acts on one reads its field.
//!
//! | variable | what it says | read by |
//! |---|---|---|
//! | `NANOGPT_MEMORY_LIMIT_MB=MB` | the memory available, overriding `MemAvailable` and the cgroup limit | the memory plan |
//! | `NANOGPT_START_TIMEOUT_S=S` | how long MPI start-up may take (default 120 s) | the start-up timer; `launch` forwards it |
//! | `NANOGPT_MPI=0\|1` | started by an MPI launcher or not, overriding the guess | `train`, `dist` |
//! | `NANOGPT_MPIRUN=PATH` | the launcher `launch` runs when `--mpirun` is not given | `launch`, tests/mpi.rs |
//! | `NANOGPT_MPI_FINALIZE=1` | call `MPI_Finalize` on MPICH across hosts anyway (it hangs there) | `dist::mpi` |
//! | `NANOGPT_CHECKIN=PORT TOKEN ADDRS` | the check-in hub `launch` serves (set by `launch`) | `dist::checkin` |
//! | `NANOGPT_API_KEY=KEY` | `serve`'s key when `--api-key` is not given | `serve` |
//! | `NANOGPT_FAULT=KIND:ITER[:ARG]` | a fault to inject (tests only) | [`crate::fault`] |
//! | `NANOGPT_EXPECT_ONEDNN` | oneDNN must be testable here (CI on bf16 CPUs) | the oneDNN tests |
//! | `NANOGPT_EXPORT_CHECK_DIR=DIR` | where tests/hf.rs leaves its export for `hf_fixtures.py --check-export` | tests/hf.rs |
//! | `NANOGPT_VENV_PYTHON=PATH` | the Python with llama-cpp-python, transformers and gguf | tests/gguf.rs |
//! | `NANOGPT_LLAMA_EXPORT_DIR=DIR` | where tests/llama.rs leaves its exports (models, and a trained adapter with nanogpt's logits) for `llama_fixtures.py --check-export` | tests/llama.rs |
//! | `NANOGPT_SMOLLM2_DIR=DIR` | SmolLM2-135M and its reference (default /tmp/smollm2-135m) | tests/llama.rs |

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use super::Tuning;

pub const MEMORY_LIMIT_MB: &str = "NANOGPT_MEMORY_LIMIT_MB";
pub const START_TIMEOUT_S: &str = "NANOGPT_START_TIMEOUT_S";
pub const MPI: &str = "NANOGPT_MPI";
pub const MPIRUN: &str = "NANOGPT_MPIRUN";
pub const MPI_FINALIZE: &str = "NANOGPT_MPI_FINALIZE";
pub const CHECKIN: &str = "NANOGPT_CHECKIN";
pub const API_KEY: &str = "NANOGPT_API_KEY";
pub const FAULT: &str = "NANOGPT_FAULT";
pub const EXPECT_ONEDNN: &str = "NANOGPT_EXPECT_ONEDNN";
pub const EXPORT_CHECK_DIR: &str = "NANOGPT_EXPORT_CHECK_DIR";
pub const VENV_PYTHON: &str = "NANOGPT_VENV_PYTHON";
pub const LLAMA_EXPORT_DIR: &str = "NANOGPT_LLAMA_EXPORT_DIR";
pub const SMOLLM2_DIR: &str = "NANOGPT_SMOLLM2_DIR";

/// How long MPI start-up may take when [`START_TIMEOUT_S`] does not say.
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(120);

/// What the variables of the module comment say, each typed; a variable not set
/// (or, for text, not valid Unicode) is None or false.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// [`MEMORY_LIMIT_MB`], in megabytes; Err: the message for a value that is not
    /// a whole number.
    pub memory_limit_mb: Result<Option<u64>, String>,
    /// [`START_TIMEOUT_S`] where it is a positive number of seconds (see
    /// [`Settings::start_timeout`]).
    pub start_timeout: Option<Duration>,
    /// [`MPI`]: `0` false, `1` true; None: guess.
    pub mpi: Option<bool>,
    /// [`MPIRUN`], as given.
    pub mpirun: Option<String>,
    /// [`MPI_FINALIZE`] is `1`.
    pub mpi_finalize: bool,
    /// [`CHECKIN`], still encoded (`dist::wire::Invitation::decode` reads it).
    pub checkin: Option<String>,
    /// [`API_KEY`], as given (perhaps empty).
    pub api_key: Option<String>,
    /// [`FAULT`], as given (perhaps empty); [`crate::fault`] parses it.
    pub fault: Option<String>,
    /// [`EXPECT_ONEDNN`] is set, to anything.
    pub expect_onednn: bool,
    /// [`EXPORT_CHECK_DIR`].
    pub export_check_dir: Option<PathBuf>,
    /// [`VENV_PYTHON`].
    pub venv_python: Option<PathBuf>,
    /// [`LLAMA_EXPORT_DIR`].
    pub llama_export_dir: Option<PathBuf>,
    /// [`SMOLLM2_DIR`].
    pub smollm2_dir: Option<PathBuf>,
    /// The A/B switches (their variables are named in [`super`]).
    pub switches: Tuning,
}

impl Settings {
    /// The settings as `var` (a variable's value, if set) gives them.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Settings {
        let text = |name: &str| var(name).and_then(|v| v.into_string().ok());
        Settings {
            memory_limit_mb: match text(MEMORY_LIMIT_MB) {
                None => Ok(None),
                Some(t) => t.trim().parse().map(Some).map_err(|_| {
                    format!("{MEMORY_LIMIT_MB} must be a whole number of megabytes, got '{t}'")
                }),
            },
            start_timeout: text(START_TIMEOUT_S)
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(Duration::from_secs_f64),
            mpi: match text(MPI).as_deref() {
                Some("0") => Some(false),
                Some("1") => Some(true),
                _ => None,
            },
            mpirun: text(MPIRUN),
            mpi_finalize: text(MPI_FINALIZE).as_deref() == Some("1"),
            checkin: text(CHECKIN),
            api_key: text(API_KEY),
            fault: text(FAULT),
            expect_onednn: var(EXPECT_ONEDNN).is_some(),
            export_check_dir: var(EXPORT_CHECK_DIR).map(PathBuf::from),
            venv_python: var(VENV_PYTHON).map(PathBuf::from),
            llama_export_dir: var(LLAMA_EXPORT_DIR).map(PathBuf::from),
            smollm2_dir: var(SMOLLM2_DIR).map(PathBuf::from),
            switches: Tuning::from_vars(text),
        }
    }

    /// How long MPI start-up may take: [`START_TIMEOUT_S`], else 120 s.
    pub fn start_timeout(&self) -> Duration {
        self.start_timeout.unwrap_or(DEFAULT_START_TIMEOUT)
    }

    /// The variables of this module that `launch` passes on to every rank, where
    /// set here: the start-up timeout and the check-in hub.
    pub fn forwarded(&self) -> Vec<&'static str> {
        let timeout = self.start_timeout.map(|_| START_TIMEOUT_S);
        let checkin = self.checkin.as_ref().map(|_| CHECKIN);
        timeout.into_iter().chain(checkin).collect()
    }
}

/// This process's settings, read from the environment on first use.
pub fn get() -> &'static Settings {
    static SETTINGS: OnceLock<Settings> = OnceLock::new();
    SETTINGS.get_or_init(|| Settings::from_vars(|name| std::env::var_os(name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(vars: &[(&str, &str)]) -> Settings {
        Settings::from_vars(|name| {
            let hit = vars.iter().find(|(n, _)| *n == name);
            hit.map(|(_, v)| OsString::from(v))
        })
    }

    #[test]
    fn unset_is_none_and_values_are_typed() {
        let none = of(&[]);
        assert_eq!(none.memory_limit_mb, Ok(None));
        assert_eq!(
            (&none.mpi, &none.mpirun, &none.checkin),
            (&None, &None, &None)
        );
        assert!(!none.mpi_finalize && !none.expect_onednn);
        assert_eq!(none.start_timeout(), Duration::from_secs(120));
        assert!(none.forwarded().is_empty());
        let s = of(&[
            (MEMORY_LIMIT_MB, " 4000 "),
            (START_TIMEOUT_S, "2.5"),
            (MPI, "0"),
            (MPI_FINALIZE, "1"),
            (CHECKIN, "4000 00000000000000aa 10.1.1.1"),
            (EXPECT_ONEDNN, ""),
        ]);
        assert_eq!(s.memory_limit_mb, Ok(Some(4000)));
        assert_eq!(s.start_timeout(), Duration::from_millis(2500));
        assert_eq!(
            (s.mpi, s.mpi_finalize, s.expect_onednn),
            (Some(false), true, true)
        );
        assert_eq!(s.forwarded(), [START_TIMEOUT_S, CHECKIN]);
        assert_eq!(of(&[(MPI, "yes"), (MPI_FINALIZE, "true")]).mpi, None);
        assert!(!of(&[(MPI_FINALIZE, "true")]).mpi_finalize);
    }

    #[test]
    fn a_bad_limit_is_a_message_and_a_bad_timeout_the_default() {
        let err = of(&[(MEMORY_LIMIT_MB, "4G")]).memory_limit_mb.unwrap_err();
        assert_eq!(
            err,
            "NANOGPT_MEMORY_LIMIT_MB must be a whole number of megabytes, got '4G'"
        );
        for bad in ["-1", "0", "inf", "soon"] {
            let s = of(&[(START_TIMEOUT_S, bad)]);
            assert_eq!(s.start_timeout(), Duration::from_secs(120), "{bad}");
        }
    }
}

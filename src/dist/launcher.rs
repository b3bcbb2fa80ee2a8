//! Which launcher started this process (from the variables launchers set in every
//! process they start) and which MPI library this binary links, so that a process
//! started by the other MPI's launcher refuses instead of training alone.
//!
//! A binary linked to MPICH but started by Open MPI's `mpirun` (or the reverse) does
//! not see the launcher: `MPI_Init` makes it a job of one, and every process trains
//! its own model. On Debian and Ubuntu with both MPIs installed, plain `mpirun` is
//! whichever one the alternatives system chose, so this is easy to get wrong.

use super::this_host;

/// The launcher families, by the variables they set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// Open MPI's `mpirun`/`mpiexec` (ORTE in 4.x, PRRTE in 5.x): `OMPI_COMM_WORLD_SIZE`.
    OpenMpi,
    /// Hydra, the `mpiexec` of MPICH and Intel MPI: `PMI_RANK`, `PMI_SIZE`, `PMI_FD`.
    Hydra,
    /// Slurm's `srun` (`SLURM_STEP_NUM_TASKS`), with whichever PMI plugin `--mpi` named.
    Srun,
}

impl Launcher {
    /// The launcher as a user knows it.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::OpenMpi => "Open MPI's mpirun",
            Launcher::Hydra => "MPICH's or Intel MPI's mpiexec (Hydra)",
            Launcher::Srun => "Slurm's srun",
        }
    }
}

/// What the launcher said about this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Started {
    pub launcher: Launcher,
    /// The number of processes it started, where it says so.
    pub size: Option<usize>,
    /// This process's rank among them, where it says so.
    pub rank: Option<usize>,
}

impl Started {
    /// `rank R of N (host H)`, or as much of it as is known.
    pub fn who(&self) -> String {
        match (self.rank, self.size) {
            (Some(r), Some(n)) => format!("rank {r} of {n} (host {})", this_host()),
            _ => format!("host {}", this_host()),
        }
    }
}

/// The launcher that started this process, read from `get` (the environment), or
/// None when no launcher's variables are set.
pub fn started_by(get: impl Fn(&str) -> Option<String>) -> Option<Started> {
    let num = |name: &str| get(name).and_then(|v| v.trim().parse::<usize>().ok());
    let slurm = get("SLURM_STEP_ID").is_some() || get("SLURM_STEP_NUM_TASKS").is_some();
    let (launcher, size, rank) = if get("OMPI_COMM_WORLD_SIZE").is_some() {
        (
            Launcher::OpenMpi,
            num("OMPI_COMM_WORLD_SIZE"),
            num("OMPI_COMM_WORLD_RANK"),
        )
    } else if get("PMI_SIZE").is_some() || get("PMI_RANK").is_some() || get("PMI_FD").is_some() {
        // srun --mpi=pmi2 sets the same variables as Hydra.
        let launcher = match slurm {
            true => Launcher::Srun,
            false => Launcher::Hydra,
        };
        (launcher, num("PMI_SIZE"), num("PMI_RANK"))
    } else if get("PMIX_RANK").is_some() {
        // PMIx: srun --mpi=pmix, or Open MPI 5's prterun.
        let launcher = match slurm {
            true => Launcher::Srun,
            false => Launcher::OpenMpi,
        };
        (launcher, num("SLURM_STEP_NUM_TASKS"), num("PMIX_RANK"))
    } else if slurm {
        (
            Launcher::Srun,
            num("SLURM_STEP_NUM_TASKS"),
            num("SLURM_PROCID"),
        )
    } else {
        return None;
    };
    Some(Started {
        launcher,
        size,
        rank,
    })
}

/// The launcher that started this process, from the environment.
pub fn started() -> Option<Started> {
    started_by(|name| std::env::var(name).ok())
}

/// The MPI library families, by `MPI_Get_library_version`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    OpenMpi,
    Mpich,
    IntelMpi,
    Other,
}

impl Library {
    /// The family of a `MPI_Get_library_version` string.
    pub fn of(version: &str) -> Library {
        if version.starts_with("Open MPI") {
            Library::OpenMpi
        } else if version.starts_with("Intel(R) MPI") {
            Library::IntelMpi
        } else if version.starts_with("MPICH") {
            Library::Mpich
        } else {
            Library::Other
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Library::OpenMpi => "Open MPI",
            Library::Mpich => "MPICH",
            Library::IntelMpi => "Intel MPI",
            Library::Other => "another MPI",
        }
    }

    /// The launcher family that starts this library's processes, if known.
    pub fn launcher(self) -> Option<Launcher> {
        match self {
            Library::OpenMpi => Some(Launcher::OpenMpi),
            Library::Mpich | Library::IntelMpi => Some(Launcher::Hydra),
            Library::Other => None,
        }
    }

    /// Its launchers' names, Debian's and Ubuntu's first (there plain `mpirun` is
    /// whichever MPI the alternatives system picked).
    pub fn launchers(self) -> &'static str {
        match self {
            Library::OpenMpi => "mpirun.openmpi (Debian/Ubuntu), Open MPI's mpirun",
            Library::Mpich => "mpirun.mpich / mpiexec.hydra (Debian/Ubuntu), MPICH's mpiexec",
            Library::IntelMpi => "Intel MPI's mpirun / mpiexec.hydra",
            Library::Other => "its own mpirun",
        }
    }
}

/// Refuses when the launcher in `started` cannot have started this process as a
/// rank of a job of `library` (`version`: its `MPI_Get_library_version`): Open
/// MPI's `mpirun` for an MPICH binary, or Hydra for an Open MPI one. `srun` is not
/// judged here (it starts either, depending on `--mpi`): the world sizes are
/// compared once MPI runs ([`check_world_size`]).
pub fn check_library(started: &Started, version: &str) -> Result<(), String> {
    let library = Library::of(version);
    let Some(wanted) = library.launcher() else {
        return Ok(());
    };
    if started.launcher == Launcher::Srun || started.launcher == wanted {
        return Ok(());
    }
    Err(format!(
        "{}: built against {} ({}), started by {}: each process would start MPI alone and \
         train alone. Use {}, or `nanogpt launch`, which picks the launcher of the MPI this \
         binary links",
        started.who(),
        library.name(),
        first_line(version),
        started.launcher.name(),
        library.launchers()
    ))
}

/// Refuses when MPI's world has another size than the launcher started (a launcher
/// of another MPI, or `srun` without the `--mpi` plugin this MPI needs).
pub fn check_world_size(started: &Started, mpi_size: usize, version: &str) -> Result<(), String> {
    let Some(size) = started.size.filter(|&n| n != mpi_size) else {
        return Ok(());
    };
    let library = Library::of(version);
    let fix = match started.launcher {
        Launcher::Srun => format!(
            "give srun the PMI plugin {} needs (`srun --mpi=pmix` for Open MPI, \
             `--mpi=pmi2` for MPICH and Intel MPI; `srun --mpi=list` shows what this Slurm \
             has)",
            library.name()
        ),
        _ => format!(
            "use {}, or `nanogpt launch`, which picks it",
            library.launchers()
        ),
    };
    Err(format!(
        "{}: {} started {size} processes, but MPI ({}, {}) sees a job of {mpi_size}: each \
         process would train alone; {fix}",
        started.who(),
        started.launcher.name(),
        library.name(),
        first_line(version),
    ))
}

fn first_line(text: &str) -> &str {
    let line = text.lines().next().unwrap_or("").trim();
    // Open MPI's is long: "Open MPI v4.1.4, package: Debian OpenMPI, ident: ...".
    line.split(", package").next().unwrap_or(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn each_launcher_is_known_by_its_variables() {
        let ompi = started_by(env(&[
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("PMIX_RANK", "1"),
        ]));
        assert_eq!(
            ompi,
            Some(Started {
                launcher: Launcher::OpenMpi,
                size: Some(3),
                rank: Some(1)
            })
        );
        let hydra = started_by(env(&[
            ("PMI_SIZE", "2"),
            ("PMI_RANK", "0"),
            ("PMI_FD", "5"),
        ]));
        assert_eq!(hydra.as_ref().map(|s| s.launcher), Some(Launcher::Hydra));
        assert_eq!(hydra.unwrap().size, Some(2));
        let pmi2 = started_by(env(&[("PMI_SIZE", "2"), ("SLURM_STEP_ID", "0")]));
        assert_eq!(pmi2.map(|s| s.launcher), Some(Launcher::Srun));
        let pmix = started_by(env(&[
            ("PMIX_RANK", "0"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_STEP_ID", "0"),
        ]));
        assert_eq!(pmix.as_ref().map(|s| s.size), Some(Some(4)));
        let bare = started_by(env(&[("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_PROCID", "1")]));
        assert_eq!(bare.as_ref().map(|s| s.rank), Some(Some(1)));
        assert_eq!(started_by(env(&[("HOME", "/root")])), None);
    }

    #[test]
    fn the_other_mpis_launcher_is_refused_naming_both() {
        let mpich = "MPICH Version:      4.0.2\nMPICH Release date: Thu May  5 2022";
        let ompi = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4";
        let by = |launcher, size| Started {
            launcher,
            size: Some(size),
            rank: Some(0),
        };
        let err = check_library(&by(Launcher::OpenMpi, 3), mpich).unwrap_err();
        assert!(
            err.contains(
                "built against MPICH (MPICH Version:      4.0.2), started by Open MPI's mpirun"
            ),
            "{err}"
        );
        assert!(err.contains("mpirun.mpich / mpiexec.hydra"), "{err}");
        let err = check_library(&by(Launcher::Hydra, 3), ompi).unwrap_err();
        assert!(
            err.contains("built against Open MPI (Open MPI v4.1.4), started by MPICH's"),
            "{err}"
        );
        assert!(err.contains("mpirun.openmpi"), "{err}");
        // The right launcher, srun, or an unknown MPI: not judged before MPI runs.
        assert!(check_library(&by(Launcher::Hydra, 3), mpich).is_ok());
        assert!(check_library(&by(Launcher::OpenMpi, 3), ompi).is_ok());
        assert!(check_library(&by(Launcher::Srun, 3), mpich).is_ok());
        assert!(check_library(&by(Launcher::OpenMpi, 3), "Some MPI 1.0").is_ok());
        assert_eq!(
            Library::of("Intel(R) MPI Library 2021.9"),
            Library::IntelMpi
        );

        // Once MPI runs: its world against the launcher's count.
        assert!(check_world_size(&by(Launcher::Hydra, 3), 3, mpich).is_ok());
        let err = check_world_size(&by(Launcher::Srun, 2), 1, ompi).unwrap_err();
        assert!(
            err.contains("Slurm's srun started 2 processes, but MPI (Open MPI, Open MPI v4.1.4) sees a job of 1"),
            "{err}"
        );
        assert!(err.contains("srun --mpi=pmix"), "{err}");
    }
}

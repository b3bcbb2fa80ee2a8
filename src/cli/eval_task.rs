//! `nanogpt eval --task KIND --data FILE.jsonl`: multiple-choice accuracy, on one
//! process or split across the ranks of an MPI job (each scores every W-th question;
//! rank 0 reads the file and prints the result).

use crate::model::ParamLayout;
use crate::model_source::load_model_with_adapter;
use crate::progress::Progress;
use crate::tasks::{self, Scorer, Tally, TaskKind, TaskReport, TaskSpec};
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::time::Instant;

/// What `eval --task` reads of `eval`'s arguments.
pub struct TaskArgs {
    pub init_from: String,
    pub adapter: Option<PathBuf>,
    pub data: PathBuf,
    pub limit: Option<usize>,
    pub threads: usize,
    pub json: bool,
}

pub fn run(args: &TaskArgs, kind: TaskKind) -> Result<()> {
    let comm = crate::dist::init()?;
    crate::threads::init_pool(args.threads, comm.local_size())?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let spec = TaskSpec {
        kind,
        path: args.data.clone(),
    };
    let loaded = load_model_with_adapter(&args.init_from, args.adapter.as_deref())?;
    // Rank 0's file is the task: the other ranks need no copy of it.
    let mut bytes = Vec::new();
    if rank == 0 {
        crate::fsutil::check_regular_file(&spec.path, "--data")?;
        bytes = std::fs::read(&spec.path)
            .with_context(|| format!("cannot read the task file {}", spec.path.display()))?;
    }
    comm.broadcast_bytes(&mut bytes, 0);
    let tokenizer = &loaded.tokenizer;
    let questions = tasks::load_task(&spec, &bytes, args.limit, tokenizer, &loaded.config)?;
    let layout = ParamLayout::new(&loaded.config);
    let mut scorer = Scorer::new(&loaded.config, &questions);
    let mine = questions.len().saturating_sub(rank).div_ceil(world);
    let mut progress = (rank == 0).then(|| Progress::counting(mine as u64, "questions"));
    let start = Instant::now();
    let params = &loaded.params;
    let ours = questions.iter().skip(rank).step_by(world);
    let tally = tasks::score::tally(&mut scorer, params, &layout, ours, |k| {
        if let Some(p) = &mut progress {
            p.set(k as u64);
        }
    });
    if let Some(p) = &mut progress {
        p.finish();
    }
    let mut sums = tally.to_array();
    comm.all_reduce_sum_f64(&mut sums);
    if rank != 0 {
        return Ok(());
    }
    let secs = start.elapsed().as_secs_f64();
    let report = TaskReport::new(spec.name(), &Tally::from_array(sums));
    crate::errln!(
        "scored {} questions in {secs:.1} s ({:.2} questions/s{})",
        report.examples,
        report.examples as f64 / secs,
        match world {
            1 => String::new(),
            w => format!(", {w} ranks"),
        }
    );
    match args.json {
        true => crate::outln!("{}", serde_json::to_string(&report)?),
        false => crate::outln!("{}", report.table()),
    }
    Ok(())
}

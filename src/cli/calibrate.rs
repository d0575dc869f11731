//! `tpc calibrate -o host.ron [--quick] [--model MODEL]`: measures this host with the
//! runtime's own kernels and communicator (`tpc::runtime::calibrate`) and writes a hardware
//! profile for `tpc simulate --hw`.

use std::path::PathBuf;
use tpc::runtime::calibrate::{measure, Settings, MAX_SHAPE_ELEMENTS};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The profile to write (RON), atomically.
    #[arg(short, long)]
    output: PathBuf,
    /// A rough measurement in a second or two (small products, few sizes), for trying the
    /// command; predictions need the full one (about half a minute).
    #[arg(long)]
    quick: bool,
    /// Time one pass of this model's linears (tp 1, program order, the LM head left out,
    /// cut to 512 MiB of bf16 weights) instead of TinyLlama-1.1B's.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Threads (cores) the host's figures are measured with (default: every core, as
    /// `tpc run` shares them out over its ranks).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    threads: Option<u64>,
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    let inputs: Vec<&std::path::Path> = a.model.iter().map(PathBuf::as_path).collect();
    tpc::fsio::check_output("-o", &a.output, &inputs)?;
    let threads = a.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |t| t as usize,
    );
    let mut settings = if a.quick {
        Settings::quick(threads)
    } else {
        Settings::full(threads)
    };
    if let Some(model) = &a.model {
        let def = tpc::frontend::load::load_model(model)?;
        let plan = tpc::pipeline::compile(&def, 1)?.plan;
        let mut shapes: Vec<(usize, usize)> = Vec::new();
        let mut skipped = 0;
        if let Some(rank) = plan.ranks.first() {
            let heads = rank.head_linears();
            let facts: std::collections::HashMap<u32, _> =
                rank.instrs.iter().map(|i| (i.id, &i.fact)).collect();
            for i in &rank.instrs {
                if !matches!(i.op, tpc::ir::Op::Linear(_)) || heads.contains(&i.id) {
                    continue;
                }
                let dims: Vec<usize> = i
                    .inputs
                    .get(1)
                    .and_then(|id| facts.get(id))
                    .map(|f| {
                        f.shape
                            .0
                            .iter()
                            .filter_map(|d| match d {
                                tpc::ir::Dim::Fixed(n) => usize::try_from(*n).ok(),
                                _ => None,
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                if let [n, k] = dims[..] {
                    if n.checked_mul(k).is_some_and(|e| e <= MAX_SHAPE_ELEMENTS) {
                        shapes.push((n, k));
                    } else {
                        skipped += 1;
                    }
                }
            }
        }
        anyhow::ensure!(
            !shapes.is_empty(),
            "{}",
            tpc::runtime::calibrate::CalibrateError::NoShapes {
                max: MAX_SHAPE_ELEMENTS
            }
        );
        if skipped > 0 {
            eprintln!(
                "calibrate: {skipped} linear(s) above {MAX_SHAPE_ELEMENTS} elements not measured"
            );
        }
        settings.shapes = shapes;
    }
    let c = measure(&settings)?;
    let profile = c.profile();
    anyhow::ensure!(
        c.host.memory_bytes > 0,
        "cannot read this host's memory size from /proc/meminfo; the profile needs it"
    );
    profile.save(&a.output)?;
    super::print_stdout(&format!("{}wrote {}\n", c.summary(), a.output.display()))
}

//! Subcommands. Each file holds its arguments and a thin `execute`.

mod agreement;
mod bench;
mod bench_comm;
mod bench_gemm;
mod bench_load;
mod calibrate;
mod compile;
mod dot;
mod explain;
mod import;
mod launcher;
mod lower;
mod progress;
mod ranks;
mod run;
mod serve;
mod simulate;
mod sizes;
mod verify;

use clap::{Parser, Subcommand};
use tpc::runtime::cpu::CpuOptions;
use tpc::runtime::device::Device;

pub use verify::Mismatch;

/// tpc: tensor-parallel compiler and executor for transformer language models.
#[derive(Debug, Parser)]
#[command(name = "tpc", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Shard a model for N ranks: plan, summary, picture.
    Compile(compile::Args),
    /// Draw a model's or a plan's sharding as Graphviz DOT.
    Dot(dot::Args),
    /// Say why each weight is split as it is, what it costs, and what the other split would.
    Explain(explain::Args),
    /// Convert a Hugging Face config.json into a RON preset.
    Import(import::Args),
    /// Write a preset out as the equivalent explicit graph.
    Lower(lower::Args),
    /// Run a model on N ranks (threads, MPI processes or GPUs) and generate tokens.
    Run(run::Args),
    /// Lay out global ranks as [ExternalDP, DP, PP, TP] and list the TP/PP/DP/EP groups.
    Ranks(ranks::Args),
    /// Serve a model over HTTP (OpenAI-compatible) with continuous batching on N ranks.
    Serve(serve::Args),
    /// Estimate a plan's time and memory on a hardware profile (α-β cost model).
    Simulate(simulate::Args),
    /// Check that tp=N reproduces tp=1 on the same inputs.
    Verify(verify::Args),
    /// Measure prefill and decode throughput (checkpoint or random weights).
    Bench(bench::Args),
    /// Measure the communicator: barrier, all-reduce algorithms, memcpy bound (threads), or
    /// tpc's all-reduce next to MPI_Allreduce (under mpirun).
    BenchComm(bench_comm::Args),
    /// Measure the linear kernels (packed bf16 / f32) against the gemm crate and read bandwidth.
    BenchGemm(bench_gemm::Args),
    /// Measure packing a checkpoint's linear weights: old f32 path against pack_slice.
    BenchLoad(bench_load::Args),
    /// Measure this host (kernels, bandwidth, communicator) and write a hardware profile.
    Calibrate(calibrate::Args),
}

pub fn execute(cli: Cli) -> anyhow::Result<()> {
    // Under mpirun, a process that runs no MPI rank still meets those that do (launcher.rs).
    let without_ranks = match &cli.command {
        Command::Run(_) | Command::Bench(_) | Command::BenchComm(_) | Command::Serve(_) => None,
        Command::Compile(_) => Some("compile"),
        Command::Dot(_) => Some("dot"),
        Command::Explain(_) => Some("explain"),
        Command::Import(_) => Some("import"),
        Command::Lower(_) => Some("lower"),
        Command::Ranks(_) => Some("ranks"),
        Command::Simulate(_) => Some("simulate"),
        Command::Verify(_) => Some("verify"),
        Command::BenchGemm(_) => Some("bench-gemm"),
        Command::BenchLoad(_) => Some("bench-load"),
        Command::Calibrate(_) => Some("calibrate"),
    };
    if let Some(name) = without_ranks {
        launcher::stand_by(name)?;
    }
    match cli.command {
        Command::Compile(a) => compile::execute(a),
        Command::Dot(a) => dot::execute(a),
        Command::Explain(a) => explain::execute(a),
        Command::Import(a) => import::execute(a),
        Command::Lower(a) => lower::execute(a),
        Command::Run(a) => run::execute(a),
        Command::Ranks(a) => ranks::execute(a),
        Command::Serve(a) => serve::execute(a),
        Command::Simulate(a) => simulate::execute(a),
        Command::Verify(a) => verify::execute(a),
        Command::Bench(a) => bench::execute(a),
        Command::BenchComm(a) => bench_comm::execute(a),
        Command::BenchGemm(a) => bench_gemm::execute(a),
        Command::BenchLoad(a) => bench_load::execute(a),
        Command::Calibrate(a) => calibrate::execute(a),
    }
}

/// How `run` and `bench` execute a plan: compute type, threads, profiling, repetitions.
#[derive(Debug, clap::Args)]
pub struct ExecArgs {
    /// Where the ranks compute: cpu, cuda (every GPU, ranks round robin) or cuda:0,1,…
    /// (needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: tpc::runtime::generate::Device,
    /// Compute type: auto (the checkpoint's), f32, or bf16 (bf16 weights, f32 accumulation).
    #[arg(long, value_enum, default_value_t = DtypeArg::Auto)]
    pub dtype: DtypeArg,
    /// Compute threads per rank (default: cores / tp).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1024))]
    pub threads_per_rank: u64,
    /// Print where rank 0's time goes, per op kind, on stderr.
    #[arg(long)]
    pub profile: bool,
    /// Pin compute threads to cores round robin (measured here: no gain beyond the noise).
    #[arg(long)]
    pub pin: bool,
    /// Untimed generations first (loading is never timed).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub warmup: u64,
    /// Timed generations; the best prefill and decode are reported.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub repeat: u64,
    /// Linear kernels to use: portable, avx2, avx512, avx512bf16 or amx (default: the best this
    /// CPU runs whose start-up self-check passes); one the CPU lacks is an error.
    #[arg(long, value_parser = parse_isa)]
    pub isa: Option<tpc::runtime::cpu::isa::Isa>,
}

pub fn parse_device(s: &str) -> Result<tpc::runtime::generate::Device, String> {
    s.parse()
}

pub fn parse_isa(s: &str) -> Result<tpc::runtime::cpu::isa::Isa, String> {
    s.parse()
        .map_err(|e: tpc::runtime::cpu::isa::KernelError| e.to_string())
}

/// `--json`'s description of the linear kernels a run used.
pub fn kernels_json(out: &tpc::runtime::generate::BatchOutput) -> serde_json::Value {
    match out.linear_kernels {
        Some(k) => serde_json::json!({
            "isa": k.isa.name(),
            "prompt_gemm": k.prompt_gemm.name(),
            "decode_gemv": k.decode_gemv.name(),
        }),
        None => serde_json::Value::Null,
    }
}

impl ExecArgs {
    /// Run options with these settings and defaults for the rest.
    pub fn options(&self) -> tpc::runtime::generate::RunOptions {
        tpc::runtime::generate::RunOptions {
            device: match &self.device {
                Device::Cpu(_) => Device::Cpu(CpuOptions {
                    isa: self.isa,
                    threads_per_rank: self.threads_per_rank as usize,
                    pin_threads: self.pin,
                }),
                gpus => gpus.clone(),
            },
            dtype: self.dtype.into(),
            profile: self.profile,
            warmup: self.warmup as usize,
            repeat: self.repeat as usize,
            ..Default::default()
        }
    }

    /// How the reported times were taken, for JSON output.
    pub fn stat(&self) -> String {
        format!("best of {} after {} warm-up", self.repeat, self.warmup)
    }
}

/// `--dtype` of `run` and `bench`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum DtypeArg {
    Auto,
    F32,
    Bf16,
}

impl From<DtypeArg> for tpc::runtime::generate::ComputeDtype {
    fn from(d: DtypeArg) -> Self {
        match d {
            DtypeArg::Auto => tpc::runtime::generate::ComputeDtype::Auto,
            DtypeArg::F32 => tpc::runtime::generate::ComputeDtype::F32,
            DtypeArg::Bf16 => tpc::runtime::generate::ComputeDtype::Bf16,
        }
    }
}

/// A saved plan, refused when `--tp` asks for another tp than it was compiled for.
pub fn plan_for_tp(
    plan: tpc::plan::Plan,
    path: &std::path::Path,
    tp: Option<u64>,
) -> anyhow::Result<tpc::plan::Plan> {
    if let Some(tp) = tp {
        anyhow::ensure!(
            tp == plan.tp,
            "the plan {} is for tp={}, not --tp {tp}; drop --tp or recompile the plan",
            path.display(),
            plan.tp
        );
    }
    Ok(plan)
}

/// How `compile`, `run`, `verify` and `bench` shard beyond tp.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct ShardArgs {
    /// Sequence parallelism: hold the residual stream split by tokens between blocks
    /// (reduce-scatter + all-gather over the sequence instead of all-reduces).
    /// `--sequence-parallel` (or `=on`) forces it, `=off` refuses it; `auto`, the default,
    /// lets the cost model choose where a hardware profile is given (`compile --hw`,
    /// `simulate`) and is off elsewhere.
    #[arg(
        long,
        value_enum,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "on",
        default_value = "auto"
    )]
    pub sequence_parallel: SequenceParallelMode,
    /// Fuse each all-reduce into the RMSNorm that reads it; the residual stream stays a
    /// partial sum (one op instead of add, all-reduce and norm).
    #[arg(long)]
    pub fuse_norm: bool,
    /// How sums are ordered: `fast` (each kernel's fastest order: the low bits of the
    /// logits depend on tp, batch and threads) or `invariant` (one order fixed by the model:
    /// logits are the same bits at every tp up to 32, in any batch, on any thread count).
    #[arg(long, value_enum, default_value = "fast")]
    pub numerics: NumericsArg,
    /// Each rank's share of every split dimension, one per rank (with --tp): `3,1,1,1`
    /// gives rank 0 three times the heads, MLP columns and vocabulary rows of each other
    /// rank (unequal devices). Rounded to whole atoms (kv groups with their query heads,
    /// MLP column and vocabulary row blocks); the compile notes give what each rank got.
    #[arg(long, value_name = "SHARES")]
    pub tp_shares: Option<tpc::ir::TpShares>,
    /// How mixture-of-experts layers are split: `tensor` (every expert's gate/up by columns
    /// and down by rows on every rank), `expert` (whole experts dealt to the ranks; each
    /// computes only its experts) or `auto` (the cheaper of the two for the workload on the
    /// hardware profile given with --hw; without one, tensor). Both end the layer in one
    /// all-reduce. Default: tensor.
    #[arg(long, value_enum)]
    pub moe: Option<MoeArg>,
}

/// `--moe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MoeArg {
    Tensor,
    Expert,
    Auto,
}

impl MoeArg {
    pub fn word(self) -> &'static str {
        match self {
            MoeArg::Tensor => "tensor",
            MoeArg::Expert => "expert",
            MoeArg::Auto => "auto",
        }
    }
}

impl From<MoeArg> for tpc::ir::ExpertSplit {
    /// The split compiled when nobody prices the choice: `auto` without a profile is the
    /// split by features.
    fn from(a: MoeArg) -> Self {
        match a {
            MoeArg::Tensor | MoeArg::Auto => tpc::ir::ExpertSplit::Tensor,
            MoeArg::Expert => tpc::ir::ExpertSplit::Expert,
        }
    }
}

/// `--numerics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NumericsArg {
    Fast,
    Invariant,
}

impl From<NumericsArg> for tpc::ir::NumericsMode {
    fn from(a: NumericsArg) -> Self {
        match a {
            NumericsArg::Fast => tpc::ir::NumericsMode::Fast,
            NumericsArg::Invariant => tpc::ir::NumericsMode::Invariant,
        }
    }
}

/// Pipeline stages (`compile`, `run`, `verify`, `bench`).
#[derive(Debug, Clone, clap::Args)]
pub struct PipelineArgs {
    /// Pipeline-parallel stages: the decoder layers split into this many contiguous
    /// stages of tp ranks each (the embedding on the first, the LM head on the last),
    /// balanced by parameter bytes and compute; pp·tp ranks in all.
    #[arg(long)]
    pub pp: Option<u64>,
    /// Layers of each stage, e.g. `8,8,8,8` (with --pp; they must sum to the model's layers).
    #[arg(long, value_delimiter = ',', requires = "pp")]
    pub pp_layers: Option<Vec<u64>>,
}

impl PipelineArgs {
    /// Splits a plan compiled now into the stages asked for.
    pub fn apply(&self, plan: &mut tpc::plan::Plan) -> tpc::error::Result<()> {
        match self.pp {
            Some(pp) => tpc::pipeline::split_stages(plan, pp, self.pp_layers.as_deref()),
            None => Ok(()),
        }
    }

    /// A saved plan, refused when `--pp` asks for other stages than it has.
    pub fn check_saved(
        &self,
        plan: &tpc::plan::Plan,
        path: &std::path::Path,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.pp_layers.is_none(),
            "--pp-layers applies when tpc compiles the model; the plan {} has its stages already: drop --pp-layers",
            path.display()
        );
        if let Some(pp) = self.pp {
            anyhow::ensure!(
                pp == plan.pp() as u64,
                "the plan {} has {} pipeline stage(s), not --pp {pp}; drop --pp or recompile the plan",
                path.display(),
                plan.pp()
            );
        }
        Ok(())
    }
}

/// The workload a plan is priced for (`simulate`, and `compile --hw`'s choices).
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct WorkloadArgs {
    /// Sequences run together, 1 to 4096.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    batch: u64,
    /// Prompt tokens per sequence, 1 to 2^24.
    // `--prompt` was its name; a hidden alias now, as `run --prompt` is text.
    #[arg(long, alias = "prompt", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    prompt_len: u64,
    /// Generated tokens per sequence, 0 to 2^24.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(0..=1 << 24))]
    gen: u64,
}

impl WorkloadArgs {
    pub fn workload(&self) -> tpc::cost::simulate::Workload {
        tpc::cost::simulate::Workload {
            batch: self.batch,
            prompt: self.prompt_len,
            gen: self.gen,
        }
    }
}

/// `json` (an object) with the cost model's decisions added, if any
/// (`sequence_parallel_decision`, `expert_split_decision`).
pub fn with_decision(
    mut json: serde_json::Value,
    decisions: &tpc::cost::decide::Decisions,
) -> serde_json::Result<serde_json::Value> {
    if let Some(fields) = json.as_object_mut() {
        if let Some(d) = &decisions.sequence_parallel {
            fields.insert(
                "sequence_parallel_decision".into(),
                serde_json::to_value(d)?,
            );
        }
        if let Some(d) = &decisions.experts {
            fields.insert("expert_split_decision".into(), serde_json::to_value(d)?);
        }
    }
    Ok(json)
}

/// `json` (an object) with the run's mixture-of-experts load, when the model has experts:
/// the (token, expert) pairs each rank of the lead's group computed, and the busiest rank's
/// load over the mean (1 is perfect balance).
pub fn with_expert_load(json: &mut serde_json::Value, pairs: &[u64]) {
    if let (Some(imbalance), Some(fields)) = (expert_imbalance(pairs), json.as_object_mut()) {
        fields.insert("moe_routed_pairs_per_rank".into(), serde_json::json!(pairs));
        fields.insert("moe_load_imbalance".into(), serde_json::json!(imbalance));
    }
}

/// The busiest rank's pairs over the mean; `None` without experts or pairs.
fn expert_imbalance(pairs: &[u64]) -> Option<f64> {
    let total: f64 = pairs.iter().map(|&p| p as f64).sum();
    let max = pairs.iter().copied().max()? as f64;
    (total > 0.0).then(|| max * pairs.len() as f64 / total)
}

/// One line for a run's text report: each rank's expert load.
pub fn expert_load_line(pairs: &[u64]) -> Option<String> {
    let imbalance = expert_imbalance(pairs)?;
    let list: Vec<String> = pairs.iter().map(u64::to_string).collect();
    Some(format!(
        "expert load, (token, expert) pairs per rank: {} (busiest / mean {imbalance:.2})",
        list.join(", ")
    ))
}

/// Whether sequence parallelism is forced, refused or left to the cost model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SequenceParallelMode {
    Auto,
    On,
    Off,
}

impl ShardArgs {
    /// The options to compile with; `auto` compiles without sequence parallelism unless a
    /// caller with a hardware profile decides ([`ShardArgs::cost_decides`]).
    pub fn options(&self) -> tpc::passes::ShardOptions {
        tpc::passes::ShardOptions {
            sequence_parallel: self.sequence_parallel == SequenceParallelMode::On,
            fuse_norm: self.fuse_norm,
            numerics: self.numerics.into(),
            shares: self.tp_shares,
            moe: self.moe.map(Into::into),
        }
    }

    /// True when the cost model is to choose sequence parallelism (given a profile).
    pub fn cost_decides(&self) -> bool {
        self.sequence_parallel == SequenceParallelMode::Auto
    }

    /// Compiles `def` for `tp` ranks: with a profile, `--sequence-parallel auto` keeps the
    /// cheaper of the plans with and without sequence parallelism for `work`, and `--moe
    /// auto` the cheaper of the two expert splits (and the decisions); else as the options
    /// say.
    pub fn compile(
        &self,
        def: &tpc::frontend::ModelDef,
        tp: u64,
        hw: Option<&tpc::cost::profile::HwProfile>,
        work: tpc::cost::simulate::Workload,
        numerics: impl Fn(&tpc::plan::Plan) -> tpc::cost::simulate::Numerics,
    ) -> tpc::error::Result<(tpc::pipeline::Compiled, tpc::cost::decide::Decisions)> {
        use tpc::cost::decide::{compile_choosing_expert_split, Decisions};
        let Some(hw) = hw else {
            return Ok((
                tpc::pipeline::compile_with(def, tp, self.options())?,
                Decisions::default(),
            ));
        };
        if self.moe == Some(MoeArg::Auto) {
            compile_choosing_expert_split(def, tp, hw, work, &numerics, |d| {
                self.compile_priced(d, tp, hw, work, &numerics)
            })
        } else {
            self.compile_priced(def, tp, hw, work, &numerics)
        }
    }

    /// [`ShardArgs::compile`] with a profile, the experts split as `def` says when `--moe
    /// auto` leaves it to the caller.
    fn compile_priced(
        &self,
        def: &tpc::frontend::ModelDef,
        tp: u64,
        hw: &tpc::cost::profile::HwProfile,
        work: tpc::cost::simulate::Workload,
        numerics: &dyn Fn(&tpc::plan::Plan) -> tpc::cost::simulate::Numerics,
    ) -> tpc::error::Result<(tpc::pipeline::Compiled, tpc::cost::decide::Decisions)> {
        let mut options = self.options();
        if self.moe == Some(MoeArg::Auto) {
            options.moe = None;
        }
        if !self.cost_decides() {
            return Ok((
                tpc::pipeline::compile_with(def, tp, options)?,
                Default::default(),
            ));
        }
        let (c, d) = tpc::cost::decide::compile_choosing_sequence_parallel(
            def, tp, options, hw, work, numerics,
        )?;
        Ok((
            c,
            tpc::cost::decide::Decisions {
                sequence_parallel: d,
                experts: None,
            },
        ))
    }
}

/// Sharding options belong to compiling; a saved plan has made those choices already.
pub fn refuse_options_with_plan(options: tpc::passes::ShardOptions) -> anyhow::Result<()> {
    anyhow::ensure!(
        options == tpc::passes::ShardOptions::default(),
        "--moe, --sequence-parallel, --fuse-norm, --numerics and --tp-shares apply when tpc compiles the model; a saved plan (--plan) was compiled with its choices already: drop one or the other"
    );
    Ok(())
}

/// Writes `text` to stdout; a full disk is an error, not a panic, and a reader that went
/// away (`tpc compile … | head`) is [`ClosedPipe`], which ends the process quietly.
pub fn print_stdout(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe => anyhow::Error::new(ClosedPipe),
            _ => anyhow::anyhow!("cannot write the result to stdout: {e}"),
        })
}

/// `println!` through [`print_stdout`]: for commands that print line by line.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cli::print_stdout(&format!("{}\n", format_args!($($arg)*)))?
    };
}
pub(crate) use outln;

/// Stdout's reader closed it: nobody wants the rest, which is not a failure.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed by its reader")]
pub struct ClosedPipe;

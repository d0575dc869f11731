//! Runtime behaviour beyond HF parity: tp=N ≡ tp=1 on every tiny preset with random
//! weights, repeatable bits, a failing rank that stops every rank, checkpoint problems
//! reported before compute, sharded checkpoints.

use crate::scratch::Scratch;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;
use tpc::frontend::load::load_model;
use tpc::frontend::ModelDef;
use tpc::ir::Op;
use tpc::pipeline::compile;
use tpc::runtime::collectives::{CollectiveError, Collectives};
use tpc::runtime::comm::{local_group, Collective, CommError, LocalComm};
use tpc::runtime::cpu::CpuBackend;
use tpc::runtime::error::RunError;
use tpc::runtime::generate::Request;
use tpc::runtime::generate::{ComputeDtype, Device, RunOptions};
use tpc::runtime::launch::launch_threads;
use tpc::runtime::random::RandomWeights;
use tpc::runtime::run::{run, run_batch};
use tpc::runtime::tensor::Tensor;
use tpc::runtime::verify::{verify_plans, VerifyReport};
use tpc::runtime::weights::Checkpoint;

fn scratch(name: &str) -> Scratch {
    Scratch::new("runtime", name)
}

#[test]
fn tp_n_reproduces_tp_1_on_every_tiny_preset() {
    for model in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gpt2",
        "tiny-neox",
        "tiny-llama-explicit",
    ] {
        let def = load_model(Path::new(&format!("models/{model}.ron"))).unwrap();
        for tp in [2, 4, 8] {
            if compile(&def, tp).is_err() {
                continue;
            }
            let r = verify(&def, tp, 7, 9);
            assert!(r.passed, "{model} tp={tp}: {r:?}");
            // Both sides ran kernels that keep activations f32 (see `Kernels::exact`).
            let isa: tpc::runtime::cpu::isa::Isa = r.isa.parse().unwrap();
            assert!(!isa.bf16_activations(), "{model}: {isa}");
            assert!(r.rel_error < 1e-5, "{model} tp={tp}: {}", r.rel_error);
        }
    }
}

#[test]
fn real_presets_cut_to_few_layers_verify() {
    // Whole real models do not fit this machine's memory twice over; their first layers do.
    for (model, layers, tp) in [
        ("models/gpt2.ron", 2, 4),
        ("models/gpt2.ron", 1, 3),
        ("models/pythia-1.4b.ron", 1, 8),
    ] {
        let mut def = load_model(Path::new(model)).unwrap();
        if let ModelDef::Preset(p) = &mut def {
            p.num_hidden_layers = layers;
        }
        let r = verify(&def, tp, 1, 5);
        assert!(r.passed, "{model} tp={tp}: {r:?}");
    }
}

#[test]
fn repeated_runs_are_bit_identical() {
    let dir = Path::new("tests/fixtures/checkpoints/qwen2-bias");
    let plan = compile(&load_model(dir).unwrap(), 4).unwrap().plan;
    let ckpt = Checkpoint::open(dir).unwrap();
    let opts = RunOptions {
        max_new_tokens: 3,
        ..Default::default()
    };
    let a = run(&plan, &ckpt, &[3, 1, 4, 1, 5], &opts).unwrap();
    let b = run(&plan, &ckpt, &[3, 1, 4, 1, 5], &opts).unwrap();
    let bits =
        |t: &tpc::runtime::tensor::Tensor| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a.prompt_logits), bits(&b.prompt_logits));
    assert_eq!(a.generated, b.generated);
}

#[test]
fn the_last_position_alone_gives_the_same_logits_and_tokens() {
    // Generation runs the LM head on the last prompt position only; it must not change it.
    for name in [
        "llama-gqa",
        "qwen3-tied",
        "gpt2",
        "neox-parallel",
        "qwen2-bias",
    ] {
        let dir = Path::new("tests/fixtures/checkpoints").join(name);
        let ckpt = Checkpoint::open(&dir).unwrap();
        for tp in [1, 2] {
            let plan = compile(&load_model(&dir).unwrap(), tp).unwrap().plan;
            let opts = |all| RunOptions {
                max_new_tokens: 4,
                all_prompt_logits: all,
                ..Default::default()
            };
            let prompt = [3, 1, 4, 1, 5, 9, 2];
            let full = run(&plan, &ckpt, &prompt, &opts(true)).unwrap();
            let last = run(&plan, &ckpt, &prompt, &opts(false)).unwrap();
            let (rows, vocab) = full.prompt_logits.rows_cols();
            assert_eq!(
                (rows, last.prompt_logits.shape.clone()),
                (7, vec![1, vocab])
            );
            let want = &full.prompt_logits.data[(rows - 1) * vocab..];
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in last.prompt_logits.data.iter().zip(want) {
                assert!((a - b).abs() <= 1e-5 * scale, "{name} tp={tp}: {a} vs {b}");
            }
            assert_eq!(full.generated, last.generated, "{name} tp={tp}");
        }
    }
}

#[test]
fn repeated_generations_in_one_run_match_a_single_one() {
    // --warmup / --repeat reset the KV cache between generations.
    let dir = Path::new("tests/fixtures/checkpoints/llama-gqa");
    let plan = compile(&load_model(dir).unwrap(), 2).unwrap().plan;
    let ckpt = Checkpoint::open(dir).unwrap();
    let once = run(&plan, &ckpt, &[3, 71, 249, 130], &RunOptions::default()).unwrap();
    let opts = RunOptions {
        warmup: 1,
        repeat: 3,
        ..Default::default()
    };
    let many = run(&plan, &ckpt, &[3, 71, 249, 130], &opts).unwrap();
    assert_eq!(once.generated, many.generated);
    assert_eq!(once.prompt_logits, many.prompt_logits);
}

/// The plan as a tpc before fused products wrote it: every linear its own product.
fn without_fused_products(plan: &tpc::plan::Plan) -> tpc::plan::Plan {
    let mut plan = plan.clone();
    plan.ranks.iter_mut().for_each(|r| r.fused.clear());
    plan
}

#[test]
fn fused_products_give_the_bits_of_separate_linears() {
    // Q/K/V and gate/up run as one product per rank; the values must not change at all:
    // prompts (the GEMM path), decode steps of one and of three sequences (GEMV), f32 and
    // bf16 weights, tensor and pipeline parallel.
    let requests: Vec<Request> = [&[3i64, 1, 4, 1, 5][..], &[9, 2, 6], &[5, 3, 5, 8, 9, 7, 9]]
        .iter()
        .map(|p| Request {
            prompt: p.to_vec(),
            max_new_tokens: None,
        })
        .collect();
    for name in ["llama-gqa", "qwen2-bias", "qwen3-tied", "llama-bf16"] {
        let dir = Path::new("tests/fixtures/checkpoints").join(name);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        for (tp, pp) in [(1, 1), (2, 1), (2, 2)] {
            let mut plan = compile(&def, tp).unwrap().plan;
            tpc::pipeline::split_stages(&mut plan, pp, None).unwrap();
            assert!(plan.ranks.iter().all(|r| r.fused.len() == 2 * 2), "{name}");
            for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
                let opts = RunOptions {
                    max_new_tokens: 4,
                    all_prompt_logits: true,
                    dtype,
                    ..Default::default()
                };
                let fused = run_batch(&plan, &ckpt, &requests, &opts).unwrap();
                let separate =
                    run_batch(&without_fused_products(&plan), &ckpt, &requests, &opts).unwrap();
                let what = format!("{name} tp={tp} pp={pp} {dtype:?}");
                for (f, s) in fused.sequences.iter().zip(&separate.sequences) {
                    let bits = |t: &Tensor| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&f.prompt_logits), bits(&s.prompt_logits), "{what}");
                    assert_eq!(f.generated, s.generated, "{what}");
                }
            }
        }
    }
}

#[test]
fn fused_weights_are_packed_as_one() {
    // llama-gqa at tp=2: q 32, k 8 and v 8 columns per rank. Packed apart they fill 2 + 1 +
    // 1 panels of 16 columns; side by side, 3.
    let dir = Path::new("tests/fixtures/checkpoints/llama-gqa");
    let plan = compile(&load_model(dir).unwrap(), 2).unwrap().plan;
    let ckpt = Checkpoint::open(dir).unwrap();
    let opts = RunOptions {
        max_new_tokens: 1,
        dtype: ComputeDtype::F32,
        ..Default::default()
    };
    let request = [Request {
        prompt: vec![1, 2],
        max_new_tokens: None,
    }];
    let fused = run_batch(&plan, &ckpt, &request, &opts).unwrap();
    let separate = run_batch(&without_fused_products(&plan), &ckpt, &request, &opts).unwrap();
    // One panel of 16 columns by 64 inputs in f32, saved per layer (2 layers).
    assert_eq!(separate.weight_bytes - fused.weight_bytes, 2 * 16 * 64 * 4);
}

#[test]
fn a_plan_file_records_its_fused_products_and_one_without_them_still_loads() {
    let dir = scratch("fused-plan");
    let def = load_model(Path::new("tests/fixtures/checkpoints/llama-gqa")).unwrap();
    let plan = compile(&def, 2).unwrap().plan;
    for ext in ["ron", "json"] {
        let path = dir.join(format!("plan.{ext}"));
        plan.save(&path).unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("fused"));
        assert_eq!(tpc::plan::Plan::load(&path).unwrap(), plan, "{ext}");
    }
    // A plan written before fused products existed: no `fused` field anywhere.
    let path = dir.join("plan.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for rank in json["ranks"].as_array_mut().unwrap() {
        rank.as_object_mut().unwrap().remove("fused").unwrap();
    }
    std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
    let old = tpc::plan::Plan::load(&path).unwrap();
    assert_eq!(old, without_fused_products(&plan));
    // A record that does not hold is refused on load, saying which and why.
    json["ranks"][1]["fused"] = serde_json::json!([{"linears": [7, 8], "columns": [1, 2]}]);
    std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
    let e = tpc::plan::Plan::load(&path).unwrap_err().to_string();
    assert!(e.contains("rank 1: fused product #0: "), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A communicator that fails on one rank at its `at`-th all-reduce (counting from 1).
struct FailsAt {
    inner: LocalComm,
    rank: usize,
    at: usize,
    calls: usize,
}

impl Collectives<Tensor> for FailsAt {
    fn rank(&self) -> usize {
        Collectives::<Tensor>::rank(&self.inner)
    }
    fn world_size(&self) -> usize {
        Collectives::<Tensor>::world_size(&self.inner)
    }
    fn all_reduce_sum(&mut self, buf: &mut Tensor) -> Result<(), CollectiveError> {
        self.calls += 1;
        if self.rank == Collectives::<Tensor>::rank(&self.inner) && self.calls == self.at {
            return Err(CollectiveError::Comm(CommError::Aborted {
                rank: self.rank,
                during: Collective::AllReduceSum,
            }));
        }
        self.inner.all_reduce_sum(buf)
    }
    fn all_gather(&mut self, l: &Tensor, o: &mut Tensor) -> Result<(), CollectiveError> {
        self.inner.all_gather(l, o)
    }
    fn reduce_scatter_sum(&mut self, i: &Tensor, o: &mut Tensor) -> Result<(), CollectiveError> {
        self.inner.reduce_scatter_sum(i, o)
    }
    fn all_gather_counts(
        &mut self,
        l: &Tensor,
        c: &[usize],
        o: &mut Tensor,
    ) -> Result<(), CollectiveError> {
        self.inner.all_gather_counts(l, c, o)
    }
    fn reduce_scatter_sum_counts(
        &mut self,
        i: &Tensor,
        c: &[usize],
        o: &mut Tensor,
    ) -> Result<(), CollectiveError> {
        self.inner.reduce_scatter_sum_counts(i, c, o)
    }
    fn all_gather_columns(
        &mut self,
        l: &Tensor,
        w: &[usize],
        o: &mut Tensor,
    ) -> Result<(), CollectiveError> {
        self.inner.all_gather_columns(l, w, o)
    }
    fn broadcast(&mut self, b: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        self.inner.broadcast(b, root)
    }
    fn send(&mut self, b: &Tensor, to: usize) -> Result<(), CollectiveError> {
        self.inner.send(b, to)
    }
    fn recv(&mut self, b: &mut Tensor, from: usize) -> Result<(), CollectiveError> {
        self.inner.recv(b, from)
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Collectives::<Tensor>::barrier(&mut self.inner)
    }
    fn abort(&mut self) {
        Collectives::<Tensor>::abort(&mut self.inner)
    }
}

#[test]
fn a_rank_failing_mid_run_stops_every_rank_with_its_error() {
    let def = load_model(Path::new("models/tiny-llama.ron")).unwrap();
    let plan = compile(&def, 4).unwrap().plan;
    let weights = RandomWeights::new(&plan, 3);
    // Rank 2 fails at its 4th all-reduce (the first of layer 1: one for the embedding, two
    // in layer 0): its peers are then waiting in that all-reduce and must be released.
    let comms: Vec<FailsAt> = local_group(4)
        .into_iter()
        .map(|inner| FailsAt {
            inner,
            rank: 2,
            at: 4,
            calls: 0,
        })
        .collect();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let request = Request {
            prompt: vec![1, 2, 3],
            max_new_tokens: None,
        };
        let r = launch_threads(&plan, &weights, comms, &|_| Ok(CpuBackend::new(1)), &|rt| {
            rt.generate(std::slice::from_ref(&request), &RunOptions::default())
        });
        let _ = tx.send(r.map(|o| o.generated_tokens()));
    });
    // A hang detector, not a speed limit: the run takes milliseconds when it works.
    let result = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("ranks hung after one failed");
    match result {
        Err(RunError::Comm(CommError::Aborted { rank: 2, .. })) => {}
        other => panic!("expected rank 2's own error, got {other:?}"),
    }
}

#[test]
fn a_corrupted_plan_is_refused_before_any_rank_runs() {
    let def = load_model(Path::new("models/tiny-llama.ron")).unwrap();
    let mut plan = compile(&def, 4).unwrap().plan;
    let broken = plan.ranks[2]
        .instrs
        .iter_mut()
        .find(|i| i.layer == Some(1) && matches!(i.op, Op::Rope(_)))
        .unwrap();
    broken.inputs[0] = 1_000_000;
    let weights = RandomWeights::new(&plan, 3);
    match run(&plan, &weights, &[1, 2, 3], &RunOptions::default()) {
        Err(RunError::Plan(e)) => {
            let text = e.to_string();
            assert!(
                text.contains("rank 2") && text.contains("layers.1"),
                "{text}"
            );
        }
        other => panic!("expected a plan error, got {other:?}"),
    }
}

/// Writes a copy of the llama-gqa checkpoint with `edit` applied to its tensors.
fn edited_checkpoint(
    name: &str,
    edit: impl Fn(&str, Dtype, Vec<usize>, Vec<u8>) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) -> Scratch {
    let src = Path::new("tests/fixtures/checkpoints/llama-gqa");
    let dir = scratch(name);
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (n, t) in st.tensors() {
        if let Some((d, s, b)) = edit(&n, t.dtype(), t.shape().to_vec(), t.data().to_vec()) {
            kept.push((n, d, s, b));
        }
    }
    let views: Vec<(String, TensorView)> = kept
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let out = safetensors::serialize(views, &None).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    dir
}

fn run_error(dir: &Path) -> String {
    let plan = compile(&load_model(dir).unwrap(), 2).unwrap().plan;
    match Checkpoint::open(dir) {
        Err(e) => e.to_string(),
        Ok(ckpt) => run(&plan, &ckpt, &[1, 2], &RunOptions::default())
            .unwrap_err()
            .to_string(),
    }
}

#[test]
fn checkpoint_problems_name_the_tensor_before_any_compute() {
    let k = "model.layers.1.self_attn.k_proj.weight";
    let missing = edited_checkpoint("missing", |n, d, s, b| (n != k).then_some((d, s, b)));
    let e = run_error(&missing);
    assert!(e.contains(k) && e.contains("missing"), "{e}");

    let reshaped = edited_checkpoint("shape", |n, d, s, b| {
        Some(if n == k {
            (d, vec![s[1], s[0]], b)
        } else {
            (d, s, b)
        })
    });
    let e = run_error(&reshaped);
    assert!(
        e.contains(k) && e.contains("has shape [64, 16], the model expects [16, 64]"),
        "{e}"
    );

    let ints = edited_checkpoint("dtype", |n, d, s, b| {
        Some(if n == k {
            (Dtype::I32, s, b)
        } else {
            (d, s, b)
        })
    });
    let e = run_error(&ints);
    assert!(e.contains(k) && e.contains("dtype I32"), "{e}");

    let truncated = scratch("truncated");
    let src = Path::new("tests/fixtures/checkpoints/llama-gqa");
    std::fs::copy(src.join("config.json"), truncated.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    std::fs::write(
        truncated.join("model.safetensors"),
        &bytes[..bytes.len() - 1000],
    )
    .unwrap();
    let e = run_error(&truncated);
    assert!(
        e.contains("truncated") || e.contains("not a valid safetensors"),
        "{e}"
    );

    let garbage = scratch("garbage");
    std::fs::copy(src.join("config.json"), garbage.join("config.json")).unwrap();
    std::fs::write(
        garbage.join("model.safetensors"),
        b"not a checkpoint at all",
    )
    .unwrap();
    let e = run_error(&garbage);
    assert!(e.contains("not a valid safetensors"), "{e}");
}

#[test]
fn a_sharded_checkpoint_runs_like_a_single_file() {
    let src = Path::new("tests/fixtures/checkpoints/llama-gqa");
    let dir = scratch("sharded");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().cloned().collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        let views: Vec<(String, TensorView)> = part
            .iter()
            .map(|n| {
                let t = st.tensor(n).unwrap();
                weight_map.insert(n.clone(), serde_json::Value::String(file.into()));
                (
                    n.clone(),
                    TensorView::new(t.dtype(), t.shape().to_vec(), t.data()).unwrap(),
                )
            })
            .collect();
        std::fs::write(
            dir.join(file),
            safetensors::serialize(views, &None).unwrap(),
        )
        .unwrap();
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let plan = compile(&load_model(&dir).unwrap(), 2).unwrap().plan;
    let opts = RunOptions {
        max_new_tokens: 4,
        ..Default::default()
    };
    let a = run(&plan, &Checkpoint::open(&dir).unwrap(), &[5, 6, 7], &opts).unwrap();
    let b = run(&plan, &Checkpoint::open(src).unwrap(), &[5, 6, 7], &opts).unwrap();
    assert_eq!(a.prompt_logits, b.prompt_logits);
    assert_eq!(a.generated, b.generated);
}

#[test]
fn bad_prompts_are_refused() {
    let dir = Path::new("tests/fixtures/checkpoints/gpt2");
    let plan = compile(&load_model(dir).unwrap(), 2).unwrap().plan;
    let ckpt = Checkpoint::open(dir).unwrap();
    let e = run(&plan, &ckpt, &[1, 250], &RunOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("token id 250 at position 1") && e.contains("250 tokens"),
        "{e}"
    );
    let e = run(&plan, &ckpt, &[], &RunOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty"), "{e}");
}

#[test]
fn a_pipeline_stage_failing_mid_run_stops_every_stage_with_its_error() {
    use tpc::runtime::launch::{launch_stages, local_groups};
    let def = load_model(Path::new("models/tiny-llama.ron")).unwrap();
    let mut plan = compile(&def, 2).unwrap().plan;
    tpc::pipeline::split_stages(&mut plan, 2, None).unwrap();
    let weights = RandomWeights::new(&compile(&def, 1).unwrap().plan, 3);
    let (comms, pipes) = local_groups(&plan).unwrap();
    assert_eq!((comms.len(), pipes.len()), (4, 4));
    // Global rank 1 (stage 0, tp rank 1) fails at its 2nd all-reduce (layer 0): its tp peer
    // waits in that all-reduce, and stage 1 waits for stage 0's hidden state.
    let wrap = |(g, inner): (usize, LocalComm)| FailsAt {
        inner,
        rank: if g < 2 { 1 } else { usize::MAX },
        at: 2,
        calls: 0,
    };
    let comms: Vec<FailsAt> = comms.into_iter().enumerate().map(wrap).collect();
    let pipes: Vec<FailsAt> = pipes
        .into_iter()
        .map(|inner| FailsAt {
            inner,
            rank: usize::MAX,
            at: 0,
            calls: 0,
        })
        .collect();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let request = Request {
            prompt: vec![1, 2, 3],
            max_new_tokens: None,
        };
        let r = launch_stages(
            &plan,
            &weights,
            comms,
            pipes,
            &|_| Ok(CpuBackend::new(1)),
            &|rt| rt.generate(std::slice::from_ref(&request), &RunOptions::default()),
        );
        let _ = tx.send(r.map(|o| o.generated_tokens()));
    });
    // A hang detector, not a speed limit: the run takes milliseconds when it works.
    let result = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("stages hung after one rank failed");
    match result {
        Err(RunError::Comm(CommError::Aborted { rank: 1, .. })) => {}
        other => panic!("expected rank 1's own error, got {other:?}"),
    }
}

/// tp=1 against tp=`tp` of `def` on the CPU, seeded random weights (as `tpc verify`).
fn verify(def: &ModelDef, tp: u64, seed: u64, prompt_len: usize) -> VerifyReport {
    let one = compile(def, 1).unwrap().plan;
    let many = compile(def, tp).unwrap().plan;
    verify_plans(&one, &many, None, seed, prompt_len, &Device::cpu()).unwrap()
}

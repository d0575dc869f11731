//! Kinds `safetensors` and `index`: a checkpoint's `model.safetensors` (its 8-byte header
//! length, JSON header and data) and a sharded checkpoint's `model.safetensors.index.json`,
//! opened as `tpc run` opens them, checked against the fixtures' plans and read rank by
//! rank. The loader promises an error, never a panic or a read outside the file.

use super::harness::{bytes_mutator, corpus, scratch, Kind, Outcome};
use super::mutate::{mutate, INTERESTING_NUMBERS};
use super::rng::Rng;
use std::path::{Path, PathBuf};
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::plan::Plan;
use tpc::runtime::weights::{load_slice, load_slice_bf16, Checkpoint, StoredRows, WeightSource};

const FIXTURES: &str = "tests/fixtures/checkpoints";

/// A fixture checkpoint: its directory name, its plan at tp=2 and its safetensors bytes.
struct Fixture {
    name: String,
    dir: PathBuf,
    plan: Plan,
}

fn fixtures() -> Vec<Fixture> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURES);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("the checkpoint fixtures")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.safetensors").is_file())
        .collect();
    dirs.sort();
    dirs.into_iter()
        .map(|dir| {
            let def = load_model(&dir).expect("a fixture's config");
            let plan = compile(&def, 2)
                .or_else(|_| compile(&def, 1))
                .expect("a fixture's plan")
                .plan;
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            Fixture { name, dir, plan }
        })
        .collect()
}

const DICT: &[&str] = &[
    "\"dtype\":\"F32\"",
    "\"dtype\":\"BF16\"",
    "\"dtype\":\"F16\"",
    "\"dtype\":\"I64\"",
    "\"dtype\":\"F8_E4M3\"",
    "\"dtype\":\"BOOL\"",
    "\"shape\":[]",
    "\"shape\":[0]",
    "\"shape\":[4294967296,4294967296]",
    "\"data_offsets\":[0,0]",
    "\"data_offsets\":[18446744073709551615,0]",
    "\"__metadata__\":{}",
    "\"weight_map\": ",
    "\"model.safetensors\"",
    "\"../model.safetensors\"",
    "\"/dev/zero\"",
    "\"\"",
    "\".\"",
    "null",
    "{}",
    "[]",
    "\"lm_head.weight\"",
    "\"model.embed_tokens.weight\"",
    "\"transformer.wte.weight\"",
    "\"wte.weight\"",
];

/// Opens the checkpoint in `dir` and reads what each fixture plan it matches needs.
fn exercise(dir: &Path, plans: &[Plan]) -> Outcome {
    let _ = Checkpoint::find(dir);
    let Ok(ckpt) = Checkpoint::open(dir) else {
        return Outcome::Rejected;
    };
    let mut accepted = false;
    for plan in plans {
        // Unchecked reads first: `check` is what the runtime runs, but the reads promise
        // an error on their own too.
        for w in &plan.ranks[0].weights {
            let mut out = Vec::new();
            let _ = ckpt.read(&w.tensor, 0, 4, &mut out);
            let _ = ckpt.read(&w.tensor, usize::MAX, 2, &mut out);
            let mut out16 = Vec::new();
            let _ = ckpt.read_bf16(&w.tensor, 1, 3, &mut out16);
            // What a packer reads: a batch of the slice's rows in the stored encoding.
            let _ = ckpt.read_stored_rows(w, 0..1, &mut StoredRows::default());
        }
        if ckpt.check(plan).is_err() {
            continue;
        }
        accepted = true;
        let last = plan.ranks.len() - 1;
        for rank in [&plan.ranks[0], &plan.ranks[last]] {
            for w in &rank.weights {
                let _ = load_slice(&ckpt, w);
                let _ = load_slice_bf16(&ckpt, w);
            }
        }
    }
    if accepted {
        Outcome::Accepted
    } else {
        Outcome::Rejected
    }
}

/// Header-aware mutation: mostly the JSON header (re-prefixed with its new length, or not),
/// sometimes the length itself, the data's end, or the raw bytes.
fn safetensors_mutator(
    rng: &mut Rng,
    input: &[u8],
    others: &[Vec<u8>],
    dict: &[&str],
    max_len: usize,
) -> Vec<u8> {
    let n = input
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
        .filter(|&n| n.checked_add(8).is_some_and(|end| end <= input.len()));
    let Some(n) = n else {
        return mutate(rng, input, others, dict, max_len);
    };
    let (header, data) = (&input[8..8 + n], &input[8 + n..]);
    let mut out = Vec::with_capacity(input.len() + 64);
    match rng.below(10) {
        0..=5 => {
            let headers: Vec<Vec<u8>> = others.iter().filter_map(|o| header_of(o)).collect();
            let h = mutate(rng, header, &headers, dict, max_len);
            let len = if rng.one_in(8) { n } else { h.len() };
            out.extend_from_slice(&(len as u64).to_le_bytes());
            out.extend_from_slice(&h);
            out.extend_from_slice(data);
        }
        6 => {
            let len: u64 = match rng.below(6) {
                0 => 0,
                1 => u64::MAX,
                2 => n as u64 + 1,
                3 => n as u64 - 1,
                4 => input.len() as u64,
                _ => INTERESTING_NUMBERS
                    .iter()
                    .filter_map(|s| s.parse().ok())
                    .nth(rng.below(12))
                    .unwrap_or(1),
            };
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&input[8..]);
        }
        7 => {
            out.extend_from_slice(input);
            out.truncate(8 + n + rng.below(data.len() + 1));
        }
        _ => out = mutate(rng, input, others, dict, max_len),
    }
    out.truncate(max_len);
    out
}

fn header_of(file: &[u8]) -> Option<Vec<u8>> {
    let n = u64::from_le_bytes(file.get(..8)?.try_into().ok()?) as usize;
    file.get(8..8usize.checked_add(n)?).map(<[u8]>::to_vec)
}

pub fn safetensors_kind() -> Kind {
    let fixtures = fixtures();
    let dir = scratch("safetensors");
    std::fs::copy(fixtures[0].dir.join("config.json"), dir.join("config.json")).unwrap();
    let mut seeds: Vec<(String, Vec<u8>)> = fixtures
        .iter()
        .map(|f| {
            let path = f.dir.join("model.safetensors");
            (
                format!("{FIXTURES}/{}/model.safetensors", f.name),
                std::fs::read(path).unwrap(),
            )
        })
        .collect();
    seeds.extend(corpus("safetensors"));
    let plans: Vec<Plan> = fixtures.into_iter().map(|f| f.plan).collect();
    let file = dir.join("model.safetensors");
    Kind {
        name: "safetensors",
        ext: "safetensors",
        default_iters: 400,
        seeds,
        dict: DICT,
        max_len: 1 << 20,
        mutator: safetensors_mutator,
        target: Box::new(move |bytes| {
            std::fs::write(&file, bytes).expect("the scratch checkpoint");
            exercise(&dir, &plans)
        }),
    }
}

/// Shard file names of a fixture: every shard is a full copy of its `model.safetensors`,
/// and the index spreads the tensors over them.
fn shards(fixture: &str) -> [String; 2] {
    [1, 2].map(|i| format!("{fixture}-0000{i}-of-00002.safetensors"))
}

fn index_seed(fixture: &Fixture) -> Vec<u8> {
    let bytes = std::fs::read(fixture.dir.join("model.safetensors")).unwrap();
    let header: serde_json::Value =
        serde_json::from_slice(&header_of(&bytes).expect("a fixture header")).unwrap();
    let names = shards(&fixture.name);
    let map: serde_json::Map<String, serde_json::Value> = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .enumerate()
        .map(|(i, k)| (k.clone(), names[i % 2].clone().into()))
        .collect();
    let index = serde_json::json!({
        "metadata": {"total_size": bytes.len()},
        "weight_map": map,
    });
    serde_json::to_vec_pretty(&index).unwrap()
}

pub fn index_kind() -> Kind {
    let fixtures = fixtures();
    let dir = scratch("index");
    std::fs::copy(fixtures[0].dir.join("config.json"), dir.join("config.json")).unwrap();
    let mut seeds = Vec::new();
    for f in &fixtures {
        for shard in shards(&f.name) {
            std::fs::copy(f.dir.join("model.safetensors"), dir.join(shard)).unwrap();
        }
        seeds.push((format!("index of {}", f.name), index_seed(f)));
    }
    seeds.extend(corpus("index"));
    let plans: Vec<Plan> = fixtures.into_iter().map(|f| f.plan).collect();
    let file = dir.join("model.safetensors.index.json");
    Kind {
        name: "index",
        ext: "json",
        default_iters: 400,
        seeds,
        dict: DICT,
        max_len: 1 << 20,
        mutator: bytes_mutator,
        target: Box::new(move |bytes| {
            std::fs::write(&file, bytes).expect("the scratch index");
            exercise(&dir, &plans)
        }),
    }
}

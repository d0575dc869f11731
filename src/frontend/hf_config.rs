//! Hugging Face `config.json` → family preset. Accepts transformers 4.x and 5.x spellings.

use super::spec::{Family, FamilyConfig, MoeConfig};
use crate::error::{Result, TpcError};
use crate::ir::quant::ScaleNames;
use crate::ir::{ActivationKind, DType, QuantFormat, Quantization, RopeScaling, F64};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

mod int4;

struct Reader<'a> {
    path: &'a Path,
    json: &'a Value,
}

impl Reader<'_> {
    fn err(&self, message: String) -> TpcError {
        TpcError::HfConfig {
            path: self.path.to_path_buf(),
            message,
        }
    }

    fn get(&self, keys: &[&str]) -> Option<&Value> {
        keys.iter()
            .find_map(|k| self.json.get(*k).filter(|v| !v.is_null()))
    }

    fn u64_opt(&self, keys: &[&str]) -> Result<Option<u64>> {
        match self.get(keys) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                self.err(format!(
                    "`{}` must be a non-negative integer, found {v}",
                    keys[0]
                ))
            }),
        }
    }

    fn u64(&self, keys: &[&str]) -> Result<u64> {
        self.u64_opt(keys)?.ok_or_else(|| {
            self.err(format!(
                "`{}` is missing; it is required for this model type",
                keys[0]
            ))
        })
    }

    fn f64_opt(&self, keys: &[&str]) -> Result<Option<f64>> {
        match self.get(keys) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(format!("`{}` must be a number, found {v}", keys[0]))),
        }
    }

    fn bool_opt(&self, keys: &[&str]) -> Result<Option<bool>> {
        match self.get(keys) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(format!("`{}` must be true or false, found {v}", keys[0]))),
        }
    }

    fn str_opt(&self, keys: &[&str]) -> Result<Option<&str>> {
        match self.get(keys) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(format!("`{}` must be a string, found {v}", keys[0]))),
        }
    }

    /// `rope_parameters` (5.x) or `rope_scaling` (4.x), whichever is present.
    fn rope_block(&self) -> Option<Reader<'_>> {
        self.get(&["rope_parameters", "rope_scaling"])
            .filter(|v| v.is_object())
            .map(|json| Reader {
                path: self.path,
                json,
            })
    }
}

fn dtype(r: &Reader) -> Result<DType> {
    match r.str_opt(&["dtype", "torch_dtype"])? {
        None | Some("bfloat16") => Ok(DType::Bf16),
        Some("float16") => Ok(DType::F16),
        Some("float32") => Ok(DType::F32),
        Some(other) => Err(r.err(format!(
            "dtype `{other}` is not supported; use bfloat16, float16 or float32"
        ))),
    }
}

fn activation(r: &Reader, keys: &[&str]) -> Result<Option<ActivationKind>> {
    Ok(match r.str_opt(keys)? {
        None => None,
        Some("silu" | "swish") => Some(ActivationKind::Silu),
        Some("gelu") => Some(ActivationKind::Gelu),
        Some("gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") => Some(ActivationKind::GeluTanh),
        Some("relu") => Some(ActivationKind::Relu),
        Some(other) => {
            return Err(r.err(format!(
                "activation `{other}` is not supported; tpc knows silu, gelu, gelu_new, gelu_pytorch_tanh and relu"
            )))
        }
    })
}

fn rope_scaling(r: &Reader) -> Result<Option<RopeScaling>> {
    let Some(block) = r.rope_block() else {
        return Ok(None);
    };
    let kind = block.str_opt(&["rope_type", "type"])?.unwrap_or("default");
    let factor = || -> Result<F64> {
        Ok(F64(block.f64_opt(&["factor"])?.ok_or_else(|| {
            r.err(format!("rope scaling `{kind}` needs `factor`"))
        })?))
    };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear { factor: factor()? })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: F64(block.f64_opt(&["low_freq_factor"])?.unwrap_or(1.0)),
            high_freq_factor: F64(block.f64_opt(&["high_freq_factor"])?.unwrap_or(4.0)),
            original_max_position_embeddings: block
                .u64_opt(&["original_max_position_embeddings"])?
                .unwrap_or(8192),
        })),
        other => Err(r.err(format!(
            "rope type `{other}` is not supported; tpc knows default, linear and llama3"
        ))),
    }
}

fn rope_theta(r: &Reader, legacy: &[&str]) -> Result<Option<f64>> {
    if let Some(t) = r.f64_opt(legacy)? {
        return Ok(Some(t));
    }
    match r.rope_block() {
        Some(b) => b.f64_opt(&["rope_theta"]),
        None => Ok(None),
    }
}

/// The attention window when it limits the model: Mistral's `sliding_window`, or Qwen2/Qwen3's
/// when `use_sliding_window` is true (their classes default to false, as HF's do). `None` when
/// the window is null, absent, switched off, or at least `max_position_embeddings` (then every
/// sequence the model allows fits in it and nothing changes).
fn sliding_window(r: &Reader, model_type: &str, context: Option<u64>) -> Result<Option<u64>> {
    let active = r
        .bool_opt(&["use_sliding_window"])?
        .unwrap_or(matches!(model_type, "mistral" | "mixtral"));
    if !active {
        return Ok(None);
    }
    let Some(window) = r.u64_opt(&["sliding_window"])? else {
        return Ok(None);
    };
    if window == 0 {
        return Err(r.err(
            "`sliding_window` 0 would let no token see any other; give the window in tokens, or null for full attention"
                .into(),
        ));
    }
    Ok(match context {
        Some(c) if window >= c => None,
        _ => Some(window),
    })
}

/// `num_key_value_heads` when the key is absent: the HF config class's default. Llama's is
/// `None` (one kv head per query head); Mistral's, Qwen2's and Qwen3's are fixed numbers.
fn hf_default_kv_heads(model_type: &str) -> Option<u64> {
    match model_type {
        "mistral" | "mixtral" => Some(8),
        "qwen3_moe" => Some(4),
        "qwen2_moe" => Some(16),
        "qwen2" | "qwen3" => Some(32),
        _ => None,
    }
}

/// The experts of a mixture-of-experts family, with the HF config classes' defaults
/// (Mixtral: 8 experts, 2 per token, always renormalized; Qwen3-MoE: 128, 8; Qwen2-MoE:
/// 60, 4, a shared expert of 5632 features; OLMoE: 64, 8; the Qwen and OLMoE ones
/// renormalize as `norm_topk_prob` says); `None` for a dense family.
fn moe(r: &Reader, family: Family) -> Result<Option<MoeConfig>> {
    let (experts, top_k) = match family {
        Family::Mixtral => (8, 2),
        Family::Qwen3Moe => (128, 8),
        Family::Qwen2Moe => (60, 4),
        Family::Olmoe => (64, 8),
        _ => return Ok(None),
    };
    let mlp_only_layers = match r.get(&["mlp_only_layers"]) {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(serde_json::Value::as_u64)
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| {
                r.err(format!(
                    "`mlp_only_layers` must be a list of layer indices, found {v}"
                ))
            })?,
    };
    Ok(Some(MoeConfig {
        num_experts: r
            .u64_opt(&["num_local_experts", "num_experts"])?
            .unwrap_or(experts),
        num_experts_per_tok: r.u64_opt(&["num_experts_per_tok"])?.unwrap_or(top_k),
        // Mixtral's and OLMoE's experts are `intermediate_size` wide (None); the Qwen
        // classes default to their own expert width.
        moe_intermediate_size: match (r.u64_opt(&["moe_intermediate_size"])?, family) {
            (Some(f), _) => Some(f),
            (None, Family::Qwen3Moe) => Some(768),
            (None, Family::Qwen2Moe) => Some(1408),
            (None, _) => None,
        },
        norm_topk_prob: match family {
            Family::Mixtral => true,
            _ => r.bool_opt(&["norm_topk_prob"])?.unwrap_or(false),
        },
        mlp_only_layers,
        decoder_sparse_step: r.u64_opt(&["decoder_sparse_step"])?,
        shared_expert_intermediate_size: match family {
            Family::Qwen2Moe => Some(
                r.u64_opt(&["shared_expert_intermediate_size"])?
                    .unwrap_or(5632),
            ),
            _ => None,
        },
        split: Default::default(),
    }))
}

/// The quantization methods tpc reads, as `quant_method` names them.
pub const QUANT_METHODS: &[&str] = &["fp8", "compressed-tensors", "gptq", "awq"];

/// What tpc reads of each method, for messages.
const QUANT_READ: &str = "fp8 (FP8 e4m3 with block scales, dynamic activations), compressed-tensors (INT8 or FP8 e4m3 weights with a scale per output channel, stored unpacked or, INT8, `pack-quantized`; INT4 weights with a scale per group or channel, symmetric or with zero points, `pack-quantized`), gptq (4-bit, `gptq` checkpoint format, desc_act true or false) and awq (4-bit, GEMM packing, zero points)";

/// A quantized checkpoint's `quantization_config`: FP8 e4m3 with block scales
/// (`quant_method: "fp8"`) and compressed-tensors' per-channel INT8 / FP8 weights are read;
/// any other method or scheme is refused by name before any weight is read (read as plain
/// weights it would fail on missing tensors that never mention quantization).
fn quantization(r: &Reader) -> Result<Option<Quantization>> {
    let Some(q) = r.json.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(None);
    };
    match q.get("quant_method").and_then(Value::as_str) {
        Some("compressed-tensors") => return compressed_tensors(r, q).map(Some),
        Some("gptq") => return int4::gptq(r, q).map(Some),
        Some("awq") => return int4::awq(r, q).map(Some),
        _ => {}
    }
    let bad = |what: String| {
        r.err(format!(
            "`quantization_config`: {what}; tpc reads {} (FP8 e4m3 with block scales, dynamic activations)",
            QUANT_METHODS.join(", ")
        ))
    };
    let text = |key: &str| q.get(key).filter(|v| !v.is_null());
    let method = text("quant_method").and_then(Value::as_str);
    if method != Some("fp8") {
        let method = method.map_or_else(
            || "no `quant_method`".to_string(),
            |m| format!("`quant_method` `{m}`"),
        );
        let format = text("format")
            .and_then(Value::as_str)
            .map(|f| format!(", format `{f}`"))
            .unwrap_or_default();
        return Err(r.err(format!(
            "the checkpoint is quantized with {method}{format}, which tpc does not read; tpc reads quant_method {QUANT_READ}. Use the model's unquantized release, or dequantize this one first (e.g. load it with transformers and save it in bf16)"
        )));
    }
    if let Some(fmt) = text("fmt") {
        if fmt.as_str() != Some("e4m3") {
            return Err(bad(format!("`fmt` {fmt} is not e4m3")));
        }
    }
    if let Some(scheme) = text("activation_scheme") {
        if scheme.as_str() != Some("dynamic") {
            return Err(bad(format!(
                "`activation_scheme` {scheme} needs stored activation scales, which tpc does not read"
            )));
        }
    }
    // HF's FineGrainedFP8Config default.
    let block = match text("weight_block_size") {
        None => [128, 128],
        Some(v) => {
            let dims: Option<Vec<u64>> = v
                .as_array()
                .map(|a| a.iter().map(|d| d.as_u64().filter(|&d| d > 0)).collect())
                .unwrap_or(None);
            match dims.as_deref() {
                Some(&[out, inp])
                    if out <= super::validate::MAX_DIM && inp <= super::validate::MAX_DIM =>
                {
                    [out, inp]
                }
                _ => {
                    return Err(bad(format!(
                        "`weight_block_size` {v} is not two positive block sizes [out, in]"
                    )))
                }
            }
        }
    };
    let modules_to_not_convert = modules_to_not_convert(q, &bad)?;
    Ok(Some(Quantization {
        format: QuantFormat::Fp8E4m3,
        block,
        scales: ScaleNames::ScaleInv,
        modules_to_not_convert,
        act_order: false,
    }))
}

/// The module names a `quantization_config` leaves unquantized (`modules_to_not_convert`):
/// names only, which tpc matches as prefixes or suffixes.
fn modules_to_not_convert(q: &Value, bad: &dyn Fn(String) -> TpcError) -> Result<Vec<String>> {
    let Some(list) = q.get("modules_to_not_convert").filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let names = list
        .as_array()
        .map(|a| a.iter().map(Value::as_str).collect::<Option<Vec<_>>>());
    let Some(Some(names)) = names else {
        return Err(bad(format!(
            "`modules_to_not_convert` {list} is not a list of module names"
        )));
    };
    names
        .into_iter()
        .map(|name| {
            // HF matches these as regular expressions or substrings; tpc matches names
            // (prefix or suffix).
            if name.contains(|c: char| "*+?[](){}|^$\\".contains(c)) {
                return Err(bad(format!(
                    "`modules_to_not_convert` entry `{name}` is a pattern; tpc matches module names only (a prefix such as `model.layers.0` or a suffix such as `mlp.gate`)"
                )));
            }
            Ok(name.to_string())
        })
        .collect()
}

/// A compressed-tensors `quantization_config` (llm-compressor's checkpoints): one scheme for
/// every `Linear`, its weights 8-bit integers (`type: int`, symmetric) or floats (`type:
/// float`, e4m3) with a scale per output channel (`strategy: channel`), stored one byte an
/// element (`format` `int-quantized`, `float-quantized` or `naive-quantized`: the `weight`
/// tensor itself, and `weight_scale [out, 1]`; INT8 also `pack-quantized`, W8A16: four to an
/// int32 in `weight_packed [out, in/4]`, each byte the value plus 128), or 4-bit integers
/// with a scale per group of inputs (`strategy: group`) or per channel, symmetric or with
/// zero points, packed eight to an int32 (`format: pack-quantized`, W4A16; `actorder:
/// group` stores `weight_g_idx`).
/// Activations are computed unquantized, so an activation scheme is accepted only where it
/// is dynamic (nothing stored for it).
fn compressed_tensors(r: &Reader, q: &Value) -> Result<Quantization> {
    let bad = |what: String| {
        r.err(format!(
            "`quantization_config` (compressed-tensors): {what}; tpc reads {QUANT_READ}"
        ))
    };
    let field = |v: &Value, key: &str| v.get(key).filter(|x| !x.is_null()).cloned();
    let format = field(q, "format").and_then(|f| f.as_str().map(str::to_string));
    let Some(groups) = q.get("config_groups").and_then(Value::as_object) else {
        return Err(bad("no `config_groups`".into()));
    };
    let mut scheme: Option<(QuantFormat, u64, bool)> = None;
    let mut format = format;
    for (name, group) in groups {
        let targets = group.get("targets").and_then(Value::as_array);
        if !targets.is_some_and(|t| t.iter().any(|t| t.as_str() == Some("Linear"))) {
            return Err(bad(format!(
                "group `{name}` targets {}; tpc reads one scheme for every `Linear`",
                group.get("targets").unwrap_or(&Value::Null)
            )));
        }
        let Some(w) = field(group, "weights") else {
            return Err(bad(format!("group `{name}` quantizes no weights")));
        };
        let get = |key: &str| field(&w, key);
        let kind = get("type").and_then(|t| t.as_str().map(str::to_string));
        let bits = get("num_bits").and_then(|b| b.as_u64());
        let strategy = get("strategy").and_then(|s| s.as_str().map(str::to_string));
        let symmetric = get("symmetric").and_then(|s| s.as_bool()) != Some(false);
        let fmt = match (kind.as_deref(), bits) {
            (Some("int"), Some(8)) => QuantFormat::Int8,
            (Some("float"), Some(8)) => QuantFormat::Fp8E4m3,
            (Some("int"), Some(4)) => QuantFormat::Int4Packed {
                zero_points: !symmetric,
            },
            _ => {
                return Err(bad(format!(
                    "group `{name}` stores {}-bit {} weights",
                    bits.map_or("?".into(), |b| b.to_string()),
                    kind.as_deref().unwrap_or("?")
                )))
            }
        };
        if let Some((first, ..)) = scheme {
            if first != fmt {
                return Err(bad("its groups store weights in different formats".into()));
            }
        }
        if get("dynamic").and_then(|d| d.as_bool()) == Some(true) {
            return Err(bad(format!(
                "group `{name}` quantizes weights dynamically (nothing stored)"
            )));
        }
        // A group's own `format` (mixed-precision configs) stands for the whole config's.
        if let Some(f) = field(group, "format").and_then(|f| f.as_str().map(str::to_string)) {
            if format
                .as_ref()
                .is_some_and(|top| *top != f && top != "mixed-precision")
            {
                return Err(bad("its groups store weights in different formats".into()));
            }
            format = Some(f);
        }
        let act_order = match get("actorder") {
            None => false,
            Some(Value::Bool(false)) => false,
            // Group order stores `weight_g_idx`; weight order only reordered the
            // quantization, its groups stay consecutive.
            Some(Value::String(a)) if matches!(a.as_str(), "group" | "dynamic") => true,
            Some(Value::String(a)) if matches!(a.as_str(), "weight" | "static") => false,
            Some(a) => {
                return Err(bad(format!(
                    "group `{name}` has `actorder` {a}; tpc reads group, weight (or their aliases dynamic, static) or none"
                )))
            }
        };
        if fmt.is_int4() {
            let group_size = match strategy.as_deref() {
                Some("group") => int4::group_size(&w, &bad)?,
                Some("channel") => 0,
                other => {
                    return Err(bad(format!(
                        "group `{name}` has 4-bit weight strategy `{}`; tpc reads a scale per group of inputs (`group`) or per output channel (`channel`)",
                        other.unwrap_or("?")
                    )))
                }
            };
            if let Some(a) = field(group, "input_activations") {
                return Err(bad(format!(
                    "group `{name}` quantizes activations too ({a}); tpc reads 4-bit weights with unquantized activations (W4A16)"
                )));
            }
            scheme = Some((fmt, group_size, act_order));
            continue;
        }
        if act_order {
            return Err(bad(format!(
                "group `{name}` has `actorder` with a scale per channel, which has no groups to order"
            )));
        }
        if strategy.as_deref() != Some("channel") || get("group_size").is_some() {
            return Err(bad(format!(
                "group `{name}` has weight strategy `{}`{}; tpc reads a scale per output channel (`channel`)",
                strategy.as_deref().unwrap_or("?"),
                get("group_size").map(|g| format!(" with group_size {g}")).unwrap_or_default()
            )));
        }
        if !symmetric {
            return Err(bad(format!(
                "group `{name}` is asymmetric (zero points); tpc reads symmetric 8-bit weights"
            )));
        }
        if let Some(a) = field(group, "input_activations") {
            if a.get("dynamic").and_then(Value::as_bool) != Some(true) {
                return Err(bad(format!(
                    "group `{name}` has static activation scales, which tpc does not read"
                )));
            }
        }
        scheme = Some((fmt, 0, false));
    }
    let Some((fmt, group_size, act_order)) = scheme else {
        return Err(bad("`config_groups` is empty".into()));
    };
    let stored = matches!(
        (fmt, format.as_deref()),
        (
            QuantFormat::Int4Packed { .. } | QuantFormat::Int8,
            Some("pack-quantized")
        ) | (
            QuantFormat::Int8 | QuantFormat::Fp8E4m3,
            Some("naive-quantized")
        ) | (QuantFormat::Int8, Some("int-quantized"))
            | (QuantFormat::Fp8E4m3, Some("float-quantized"))
    );
    if !stored {
        return Err(bad(format!(
            "{} weights in `format` {} are not read ({})",
            fmt.name(),
            format.as_deref().unwrap_or("missing"),
            if fmt.is_int4() {
                "4-bit weights are read packed eight to an int32, `pack-quantized`"
            } else {
                "8-bit weights are read unpacked, a byte an element: `int-quantized`, `float-quantized` or `naive-quantized`, and INT8 also four to an int32, `pack-quantized`"
            }
        )));
    }
    let mut modules_to_not_convert = Vec::new();
    if let Some(list) = field(q, "ignore") {
        let names = list
            .as_array()
            .map(|a| a.iter().map(Value::as_str).collect::<Option<Vec<_>>>());
        let Some(Some(names)) = names else {
            return Err(bad(format!(
                "`ignore` {list} is not a list of module names"
            )));
        };
        for name in names {
            if name.starts_with("re:") {
                return Err(bad(format!(
                    "`ignore` entry `{name}` is a pattern; tpc matches module names only (a prefix or a suffix)"
                )));
            }
            modules_to_not_convert.push(name.to_string());
        }
    }
    Ok(Quantization {
        format: fmt,
        block: [1, group_size],
        scales: ScaleNames::Scale,
        modules_to_not_convert,
        act_order,
    })
}

/// The quantization an HF `config.json` states (`None` for none): what a checkpoint reader
/// needs to decode the weights beside it.
pub fn quantization_in(path: &Path, json: &Value) -> Result<Option<Quantization>> {
    quantization(&Reader { path, json })
}

/// Reads an HF config into the matching family preset. Keys a config leaves out take the
/// HF config class's default where it differs from the tpc family default.
pub fn family_from_hf_json(path: &Path, json: &Value) -> Result<FamilyConfig> {
    let r = Reader { path, json };
    if !json.is_object() {
        return Err(r.err("the file must hold a JSON object".into()));
    }
    let model_type = r
        .str_opt(&["model_type"])?
        .ok_or_else(|| r.err("`model_type` is missing".into()))?;
    let family = match model_type {
        "llama" | "mistral" => Family::Llama,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        "gpt2" => Family::Gpt2,
        "gpt_neox" => Family::GptNeox,
        "mixtral" => Family::Mixtral,
        "qwen3_moe" => Family::Qwen3Moe,
        "deepseek_v2" | "deepseek_v3" | "kimi_k2" => {
            return Err(r.err(format!(
                "model_type `{model_type}` is a mixture of experts with multi-head latent attention (compressed, low-rank keys and values with a decoupled rotary part), which tpc has no op for; tpc's mixture-of-experts families are mixtral, qwen2_moe, qwen3_moe and olmoe"
            )))
        }
        "qwen2_moe" => Family::Qwen2Moe,
        "olmoe" => Family::Olmoe,
        other => {
            return Err(r.err(format!(
                "model_type `{other}` is not supported; tpc reads llama, mistral, qwen2, qwen3, gpt2, gpt_neox, mixtral, qwen2_moe, qwen3_moe and olmoe \
                 (or write the architecture as an explicit graph in RON)"
            )))
        }
    };
    let quantization = quantization(&r)?;
    if r.bool_opt(&["mlp_bias"])? == Some(true) {
        return Err(r.err(
            "`mlp_bias: true` is not supported; tpc's presets have no MLP biases for this model type \
             (write the architecture as an explicit graph in RON)"
                .into(),
        ));
    }
    let name = r
        .str_opt(&["_name_or_path"])?
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .or_else(|| Some(model_type.to_string()));
    let mut c = if family == Family::Gpt2 {
        let h = r.u64(&["n_embd", "hidden_size"])?;
        let intermediate_size = match r.u64_opt(&["n_inner"])? {
            Some(n) => n,
            None => h
                .checked_mul(4)
                .ok_or_else(|| r.err(format!("`n_embd` {h} is too large")))?,
        };
        FamilyConfig {
            family,
            name,
            hidden_size: h,
            intermediate_size,
            num_hidden_layers: r.u64(&["n_layer", "num_hidden_layers"])?,
            num_attention_heads: r.u64(&["n_head", "num_attention_heads"])?,
            num_key_value_heads: None,
            head_dim: None,
            vocab_size: r.u64(&["vocab_size"])?,
            max_position_embeddings: r.u64_opt(&["n_positions", "max_position_embeddings"])?,
            norm_eps: r.f64_opt(&["layer_norm_epsilon"])?,
            rope_theta: None,
            rope_scaling: None,
            rotary_pct: None,
            attention_bias: None,
            tie_word_embeddings: r.bool_opt(&["tie_word_embeddings"])?,
            use_parallel_residual: None,
            hidden_act: activation(&r, &["activation_function"])?,
            sliding_window: None,
            dtype: DType::F32,
            tp_plan: BTreeMap::new(),
            moe: None,
            quantization: None,
        }
    } else {
        FamilyConfig {
            family,
            name,
            hidden_size: r.u64(&["hidden_size"])?,
            intermediate_size: r.u64(&["intermediate_size"])?,
            num_hidden_layers: r.u64(&["num_hidden_layers"])?,
            num_attention_heads: r.u64(&["num_attention_heads"])?,
            num_key_value_heads: match json.get("num_key_value_heads") {
                // Absent: the HF class default. Null: HF falls back to num_attention_heads.
                None => hf_default_kv_heads(model_type),
                Some(_) => r.u64_opt(&["num_key_value_heads"])?,
            },
            head_dim: match r.u64_opt(&["head_dim"])? {
                Some(d) => Some(d),
                // Qwen3MoeConfig has no head_dim default: hidden_size / heads.
                None if family == Family::Qwen3Moe => None,
                // Qwen3Config's head_dim defaults to 128, not hidden_size / heads.
                None if family == Family::Qwen3 => Some(128),
                None => None,
            },
            vocab_size: r.u64(&["vocab_size"])?,
            max_position_embeddings: r.u64_opt(&["max_position_embeddings"])?,
            norm_eps: r.f64_opt(&["rms_norm_eps", "layer_norm_eps"])?,
            rope_theta: rope_theta(&r, &["rope_theta", "rotary_emb_base"])?,
            rope_scaling: rope_scaling(&r)?,
            rotary_pct: match r.f64_opt(&["rotary_pct", "partial_rotary_factor"])? {
                Some(p) => Some(p),
                None => match r.rope_block() {
                    Some(b) => b.f64_opt(&["partial_rotary_factor"])?,
                    None => None,
                },
            }
            // GPTNeoXConfig rotates a quarter of each head unless told otherwise.
            .or((family == Family::GptNeox).then_some(0.25)),
            attention_bias: r.bool_opt(&["attention_bias"])?,
            tie_word_embeddings: r.bool_opt(&["tie_word_embeddings"])?,
            use_parallel_residual: r.bool_opt(&["use_parallel_residual"])?,
            hidden_act: activation(&r, &["hidden_act"])?,
            sliding_window: None,
            dtype: DType::Bf16,
            tp_plan: BTreeMap::new(),
            moe: moe(&r, family)?.map(Box::new),
            quantization: None,
        }
    };
    if family == Family::Gpt2 {
        // GPT-2 checkpoints carry no dtype and are stored in f32.
        c.dtype = match r.get(&["dtype", "torch_dtype"]) {
            Some(_) => dtype(&r)?,
            None => DType::F32,
        };
    } else {
        c.dtype = dtype(&r)?;
    }
    c.sliding_window = sliding_window(&r, model_type, c.max_position_embeddings)?;
    c.quantization = quantization;
    if family == Family::Qwen2 {
        // Qwen2 always has q/k/v bias (not in its config).
        c.attention_bias = Some(true);
    }
    if family == Family::Qwen2Moe {
        // Qwen2-MoE's q/k/v bias is `qkv_bias` (default true); o_proj never has one.
        c.attention_bias = Some(r.bool_opt(&["qkv_bias"])?.unwrap_or(true));
    }
    if family == Family::Olmoe {
        if let Some(clip) = r.get(&["clip_qkv"]).filter(|v| !v.is_null()) {
            return Err(r.err(format!(
                "`clip_qkv` {clip} clamps q, k and v after their projections, which tpc has no op for; only OLMoE checkpoints with clip_qkv null are supported"
            )));
        }
    }
    Ok(c)
}

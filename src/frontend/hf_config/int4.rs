//! `quantization_config` of INT4 checkpoints as GPTQ and AWQ publish them: 4-bit weights
//! with a scale and a zero point per output per group of inputs. What is read is stated in
//! the IR ([`Quantization`]: the format names the packing, the block `[1, group]`); anything
//! the reader would misread (other bit widths, other packings, per-module overrides) is
//! refused here by name, before any weight is read.

use super::{Reader, QUANT_READ};
use crate::error::Result;
use crate::ir::quant::ScaleNames;
use crate::ir::{QuantFormat, Quantization};
use serde_json::Value;

/// The group size a config states: `-1` (one group across the inputs) as 0, otherwise a
/// positive multiple of 8 (the inputs a packed word holds) no larger than a dim can be.
pub(super) fn group_size(q: &Value, bad: &dyn Fn(String) -> crate::error::TpcError) -> Result<u64> {
    let Some(g) = q.get("group_size").filter(|v| !v.is_null()) else {
        return Err(bad("no `group_size`".into()));
    };
    match g.as_i64() {
        Some(-1) => Ok(0),
        Some(n) if n >= 8 && n % 8 == 0 && n as u64 <= crate::frontend::validate::MAX_DIM => {
            Ok(n as u64)
        }
        _ => Err(bad(format!(
            "`group_size` {g} is not -1 or a positive multiple of 8"
        ))),
    }
}

/// `bits` must be 4: the packings below hold eight elements a word.
fn four_bits(q: &Value, bad: &dyn Fn(String) -> crate::error::TpcError) -> Result<()> {
    match q.get("bits").and_then(Value::as_u64) {
        Some(4) => Ok(()),
        other => Err(bad(format!(
            "{}-bit weights are not read (4-bit only)",
            other.map_or("?".into(), |b| b.to_string())
        ))),
    }
}

/// GPTQ (`quant_method: "gptq"`, AutoGPTQ's and GPTQModel's `gptq` checkpoint format):
/// `qweight [in/8, out]` int32, `qzeros [groups, out/8]` int32 (each zero stored one less),
/// `scales [groups, out]` f16, `g_idx [in]` int32; `desc_act` true or false.
pub(super) fn gptq(r: &Reader, q: &Value) -> Result<Quantization> {
    let bad = |what: String| {
        r.err(format!(
            "`quantization_config` (gptq): {what}; tpc reads {QUANT_READ}"
        ))
    };
    four_bits(q, &bad)?;
    let group = group_size(q, &bad)?;
    let text = |key: &str| q.get(key).filter(|v| !v.is_null());
    if let Some(f) = text("checkpoint_format") {
        if f.as_str() != Some("gptq") {
            return Err(bad(format!(
                "`checkpoint_format` {f} is not read (the `gptq` format only: zeros stored one less, packed eight to an int32)"
            )));
        }
    }
    let act_order = match text("desc_act") {
        None => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| bad(format!("`desc_act` {v} is not true or false")))?,
    };
    if text("lm_head").and_then(Value::as_bool) == Some(true) {
        return Err(bad("its output head is quantized (`lm_head: true`)".into()));
    }
    if let Some(d) = text("dynamic").filter(|d| d.as_object().is_some_and(|o| !o.is_empty())) {
        return Err(bad(format!(
            "`dynamic` {d} quantizes some modules otherwise (one scheme for every linear only)"
        )));
    }
    if let Some(m) = text("modules_in_block_to_quantize") {
        return Err(bad(format!(
            "`modules_in_block_to_quantize` {m} leaves some linears unquantized (every linear of a block only)"
        )));
    }
    Ok(Quantization {
        format: QuantFormat::Int4Gptq,
        block: [1, group],
        scales: ScaleNames::Scale,
        modules_to_not_convert: super::modules_to_not_convert(q, &bad)?,
        act_order,
    })
}

/// AWQ (`quant_method: "awq"`, AutoAWQ's GEMM packing, `version: "gemm"`): `qweight [in,
/// out/8]` and `qzeros [groups, out/8]` int32, eight outputs a word in the order 0 2 4 6 1 3
/// 5 7, `scales [groups, out]` f16, zero points (`zero_point: true`).
pub(super) fn awq(r: &Reader, q: &Value) -> Result<Quantization> {
    let bad = |what: String| {
        r.err(format!(
            "`quantization_config` (awq): {what}; tpc reads {QUANT_READ}"
        ))
    };
    four_bits(q, &bad)?;
    let group = group_size(q, &bad)?;
    let text = |key: &str| q.get(key).filter(|v| !v.is_null());
    let version = text("version")
        .and_then(Value::as_str)
        .map(str::to_ascii_lowercase);
    if version.as_deref().is_some_and(|v| v != "gemm") {
        return Err(bad(format!(
            "`version` {} is not read (the GEMM packing only; GEMV, exllama, IPEX and Marlin pack differently)",
            version.unwrap_or_default()
        )));
    }
    if text("zero_point").and_then(Value::as_bool) == Some(false) {
        return Err(bad(
            "`zero_point: false` is not read (weights with zero points only)".into(),
        ));
    }
    Ok(Quantization {
        format: QuantFormat::Int4Awq,
        block: [1, group],
        scales: ScaleNames::Scale,
        modules_to_not_convert: super::modules_to_not_convert(q, &bad)?,
        act_order: false,
    })
}

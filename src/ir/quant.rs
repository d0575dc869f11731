//! Quantized weights as a fact of the IR: how a checkpoint stores a linear weight (the
//! format, and the blocks that share one scale), so that the split falls on block
//! boundaries and every report counts the bytes as stored.
//!
//! Read so far: FP8 e4m3 with block scales (`quant_method: "fp8"`, HF `weight_block_size`,
//! the `*_scale_inv` tensors of the Qwen3 and DeepSeek FP8 releases), and from
//! compressed-tensors checkpoints INT8 and FP8 weights with a scale per output channel
//! (`*_scale [out, 1]`), and INT4 weights with a scale and a zero point per group of inputs
//! in GPTQ's and AWQ's packings (`qweight`, `qzeros`, `scales`, GPTQ's `g_idx`) and in
//! compressed-tensors' `pack-quantized` one (`weight_packed`, `weight_scale`,
//! `weight_zero_point`, `weight_g_idx`). A block of 0
//! along a dim is the whole dim: one scale across it, which no split can cut.

use super::groups::SliceRange;
use serde::{Deserialize, Serialize};

/// How the elements of a quantized weight are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum QuantFormat {
    /// One byte per element, e4m3 (`float8_e4m3fn`), times an f32 scale per block.
    Fp8E4m3,
    /// One byte per element, a signed integer (symmetric: no zero point), times its scale.
    Int8,
    /// Four bits per element, eight to an int32 along the inputs (`qweight [in/8, out]`),
    /// minus a zero point and times an f16 scale per output per group of inputs; the zeros
    /// packed eight outputs to an int32 and stored one less (GPTQ's `gptq` checkpoint
    /// format); `g_idx` names each input's group.
    Int4Gptq,
    /// Four bits per element, eight outputs to an int32 in AWQ's interleaved order
    /// (`qweight [in, out/8]`, the GEMM packing), zeros packed the same way, f16 scales.
    Int4Awq,
    /// Four bits per element as compressed-tensors' `pack-quantized` format stores them:
    /// eight inputs to an int32 (`weight_packed [out, in/8]`), each code the signed value
    /// plus 8, a scale per output per group (`weight_scale [out, groups]`), and — unless the
    /// scheme is symmetric (zero 8) — zero points packed eight outputs to an int32
    /// (`weight_zero_point [out/8, groups]`); `weight_g_idx` in group act order.
    Int4Packed { zero_points: bool },
}

impl QuantFormat {
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Fp8E4m3 => "fp8 e4m3",
            QuantFormat::Int8 => "int8",
            QuantFormat::Int4Gptq => "int4 gptq",
            QuantFormat::Int4Awq => "int4 awq",
            QuantFormat::Int4Packed { zero_points: true } => "int4 pack-quantized",
            QuantFormat::Int4Packed { zero_points: false } => "int4 pack-quantized symmetric",
        }
    }

    /// Whether elements are packed four bits each into int32 words with zero points.
    pub fn is_int4(self) -> bool {
        matches!(
            self,
            QuantFormat::Int4Gptq | QuantFormat::Int4Awq | QuantFormat::Int4Packed { .. }
        )
    }

    /// Whether the checkpoint stores a zero point per group (a symmetric INT4 scheme's is 8).
    pub fn stores_zeros(self) -> bool {
        matches!(
            self,
            QuantFormat::Int4Gptq
                | QuantFormat::Int4Awq
                | QuantFormat::Int4Packed { zero_points: true }
        )
    }

    /// Elements per stored word along a weight's outputs and inputs: a split that cut a
    /// word would leave part of it on another rank. INT4 zeros pack eight outputs a word in
    /// every packing; GPTQ's and compressed-tensors' weights pack eight inputs, AWQ's eight
    /// outputs.
    pub fn packed(self) -> [u64; 2] {
        match self {
            QuantFormat::Fp8E4m3 | QuantFormat::Int8 => [1, 1],
            QuantFormat::Int4Gptq | QuantFormat::Int4Packed { .. } => [8, 8],
            QuantFormat::Int4Awq => [8, 1],
        }
    }
}

/// How a checkpoint names a quantized weight's scales: `<weight>_scale_inv` (the `fp8`
/// method's), or `<weight>_scale` (compressed-tensors').
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum ScaleNames {
    #[default]
    ScaleInv,
    Scale,
}

impl ScaleNames {
    pub fn suffix(self) -> &'static str {
        match self {
            ScaleNames::ScaleInv => "_scale_inv",
            ScaleNames::Scale => "_scale",
        }
    }
}

/// Scales along a dim of `len` elements in blocks of `block` (0: the whole dim, one).
pub fn blocks_along(len: u64, block: u64) -> u64 {
    if block == 0 {
        len.min(1)
    } else {
        len.div_ceil(block)
    }
}

/// `[out, in]` blocks in words: "128 × 128 block", "output channel".
pub fn describe_block(block: [u64; 2]) -> String {
    match block {
        [1, 0] => "output channel".to_string(),
        [1, g] => format!("group of {g} inputs of an output"),
        [a, b] => format!("{a} × {b} block"),
    }
}

/// A model's quantization, as its `quantization_config` states it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Quantization {
    pub format: QuantFormat,
    /// Elements per scale along a linear weight's output and input dims (HF
    /// `weight_block_size`, `[out, in]`).
    pub block: [u64; 2],
    /// How the checkpoint names the scales.
    #[serde(default)]
    pub scales: ScaleNames,
    /// Weights left unquantized, as HF `modules_to_not_convert` names their modules: a
    /// module whose name starts or ends with one of these stays in the model's dtype. The
    /// output head and embeddings are never quantized.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub modules_to_not_convert: Vec<String>,
    /// GPTQ's `desc_act`: inputs were quantized in order of activation size, so a group's
    /// inputs lie anywhere along the dim (`g_idx` says where) and a split of the inputs
    /// need not fall on group boundaries: each rank reads the scales its inputs name.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub act_order: bool,
}

impl Quantization {
    /// Whether the linear weight `tensor` (`<module>.weight`) is stored quantized.
    pub fn covers(&self, tensor: &str) -> bool {
        let module = tensor.strip_suffix(".weight").unwrap_or(tensor);
        !self.modules_to_not_convert.iter().any(|m| {
            !m.is_empty() && (module.starts_with(m.as_str()) || module.ends_with(m.as_str()))
        })
    }

    /// The fact for a linear weight stored `[out, in]` (`out_dim` 0) or `[in, out]`.
    pub fn for_weight(&self, out_dim: u32) -> Quantized {
        let [out, inp] = self.block;
        Quantized {
            format: self.format,
            block: if out_dim == 0 { [out, inp] } else { [inp, out] },
            act_order: self.act_order,
        }
    }
}

/// One weight's quantization: its format and the block of elements that share a scale,
/// per stored dim of the 2-D weight — the last two dims of a stack of experts' weights
/// (`[experts, out, in]`, each expert its own checkpoint tensor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Quantized {
    pub format: QuantFormat,
    pub block: [u64; 2],
    /// GPTQ's `desc_act` (see [`Quantization::act_order`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub act_order: bool,
}

impl Quantized {
    /// How the weight is stored and what that asks of a split, in words.
    pub fn describe(&self) -> String {
        let block = describe_block(self.block);
        if !self.format.is_int4() {
            return format!(
                "{}, one f32 scale per {block}; a split keeps every block on one rank",
                self.format.name()
            );
        }
        format!(
            "{}, 4 bits an element packed eight to an int32, a 16-bit scale{} per {block}; a split keeps every {}packed word on one rank",
            self.format.name(),
            if self.format.stores_zeros() {
                " and a 4-bit zero"
            } else {
                ""
            },
            if self.act_order {
                "" // The groups are scattered along the inputs (g_idx).
            } else {
                "group and "
            }
        ) + if self.act_order {
            " (act order: groups lie anywhere along the inputs, g_idx names them, so each rank reads the scales its inputs name)"
        } else {
            ""
        }
    }

    /// The shape of the scales of a weight stored `shape` (one per block, the last block
    /// of a dim partial), `None` for a weight that is not 2-D.
    pub fn scale_shape(&self, shape: &[u64]) -> Option<[u64; 2]> {
        match shape {
            [a, b] => Some([
                blocks_along(*a, self.block[0]),
                blocks_along(*b, self.block[1]),
            ]),
            _ => None,
        }
    }

    /// Bytes a rank holds for a piece of `local_shape`, whole blocks of scales included:
    /// for FP8 and INT8 one byte per element and an f32 per block that the piece touches;
    /// for INT4 half a byte per element, a 16-bit scale and (unless symmetric) a 4-bit zero
    /// per group of each output, and (GPTQ, and compressed-tensors in act order) an int32
    /// `g_idx` entry per input.
    pub fn stored_bytes(&self, local_shape: &[u64]) -> u64 {
        use super::saturating::product;
        let elements = product(local_shape.iter().copied());
        let [lead, a, b] = match local_shape {
            [lead @ .., a, b] => [product(lead.iter().copied()), *a, *b],
            _ => return elements,
        };
        let scales = lead.saturating_mul(
            blocks_along(a, self.block[0]).saturating_mul(blocks_along(b, self.block[1])),
        );
        if !self.format.is_int4() {
            return elements.saturating_add(scales.saturating_mul(4));
        }
        // INT4 weights are stored `[out, in]`.
        let g_idx = match self.format {
            QuantFormat::Int4Gptq => lead.saturating_mul(b).saturating_mul(4),
            QuantFormat::Int4Packed { .. } if self.act_order => {
                lead.saturating_mul(b).saturating_mul(4)
            }
            _ => 0,
        };
        let per_group = if self.format.stores_zeros() { 5 } else { 4 };
        elements
            .div_ceil(2)
            .saturating_add(scales.saturating_mul(per_group).div_ceil(2))
            .saturating_add(g_idx)
    }

    /// Bytes tpc's CPU runtime holds for a piece of `local_shape` stored `[out, in]` when it
    /// keeps the codes: a byte per element (FP8, INT8) or half a byte (INT4), and an f32
    /// per output row per block of inputs (its products' scales, one per column of a packed
    /// panel; INT4 adds an f32 zero point). INT4 in act order keeps its codes stored sorted
    /// by group, with the order (8 bytes an input); where a row split cuts the inputs,
    /// each rank's share of a scattered group fills a block of slots as long
    /// as the largest share, whose padding depends on `g_idx` and is not counted here.
    pub fn column_scaled_bytes(&self, local_shape: &[u64]) -> u64 {
        let act_order = self.format.is_int4() && self.act_order;
        let elements = super::saturating::product(local_shape.iter().copied());
        let scales = match local_shape {
            [lead @ .., a, b] => super::saturating::product(lead.iter().copied())
                .saturating_mul(a.saturating_mul(blocks_along(*b, self.block[1]))),
            _ => 0,
        };
        let order = match local_shape.last() {
            Some(inputs) if act_order => inputs.saturating_mul(8),
            _ => 0,
        };
        if self.format.is_int4() {
            elements
                .div_ceil(2)
                .saturating_add(scales.saturating_mul(8))
                .saturating_add(order)
        } else {
            elements.saturating_add(scales.saturating_mul(4))
        }
    }

    /// Elements along stored dim `along` (0 or 1 of the 2-D weight) that a split must keep
    /// on one rank, and what they are: a block sharing a scale, or a packed word (INT4
    /// weights are stored `[out, in]`). GPTQ's act-order groups are scattered along the
    /// inputs, so there only the words bind.
    fn atom(&self, along: usize) -> Option<(u64, &'static str)> {
        let block = *self.block.get(along)?;
        let word = self.format.packed()[along];
        let grouped = block > 1 && !(self.act_order && along == 1);
        match (grouped, word > 1) {
            (true, true) if block.is_multiple_of(word) => Some((block, "scale groups")),
            (true, true) => Some((block.saturating_mul(word), "scale groups and packed words")),
            (true, false) if self.format.is_int4() => Some((block, "scale groups")),
            (true, false) => Some((block, "scale blocks")),
            (false, true) => Some((word, "packed words")),
            (false, false) => None,
        }
    }

    /// The elements a split of either stored dim keeps together: the least common multiple
    /// of both dims' atoms (1 where neither has one). A dimension that one weight has as its
    /// outputs and the next as its inputs (an MLP's columns) must fall on both.
    pub fn split_block(&self) -> u64 {
        [0, 1]
            .into_iter()
            .filter_map(|along| self.atom(along))
            .fold(1, |b, (atom, _)| super::saturating::lcm(b, atom))
    }

    /// Why a piece of dim `dim` of an `ndim`-dim weight (`total` elements along it) made of
    /// `ranges` would cut one of the blocks that share a scale: a range that starts inside a
    /// block, or ends inside one short of the dim's end. `None` when every range keeps its
    /// blocks whole (a stack's experts dim has no blocks).
    pub fn cut_by(
        &self,
        dim: u32,
        ndim: usize,
        total: u64,
        ranges: &[SliceRange],
    ) -> Option<String> {
        let along = (dim as usize).checked_sub(ndim.checked_sub(2)?)?;
        let (block, what) = self.atom(along)?;
        ranges.iter().find_map(|r| {
            let end = r.offset.saturating_add(r.len);
            let inside = |at: u64| !at.is_multiple_of(block) && at != total;
            (inside(r.offset) || inside(end)).then(|| {
                format!(
                    "elements {}..{end} of {total} would cut the checkpoint's {} {what} of {block}",
                    r.offset,
                    self.format.name()
                )
            })
        })
    }
}

/// The elements an uneven split of a plain dimension (an MLP's columns) deals together in
/// `graph`: every quantized weight's [`Quantized::split_block`], combined (1 when nothing
/// is quantized). Plan-wide, so that every weight sharing a dimension, quantized or not
/// (a bias), is dealt alike.
pub fn graph_split_block(graph: &super::Graph) -> u64 {
    graph
        .g
        .node_weights()
        .filter_map(|n| match &n.op {
            super::Op::Param(p) => p.quant,
            _ => None,
        })
        .fold(1, |b, q| super::saturating::lcm(b, q.split_block()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp8(block: [u64; 2]) -> Quantized {
        Quantized {
            format: QuantFormat::Fp8E4m3,
            block,
            act_order: false,
        }
    }

    fn range(offset: u64, len: u64) -> SliceRange {
        SliceRange {
            offset,
            len,
            pad: 0,
        }
    }

    #[test]
    fn a_piece_keeps_its_blocks_whole_or_says_where_it_cuts() {
        let q = fp8([128, 128]);
        // 11008 columns at tp 2: 5504 = 43 blocks each, whole.
        assert!(q.cut_by(0, 2, 11008, &[range(5504, 5504)]).is_none());
        // tp 4: 2752 = 21.5 blocks.
        let why = q.cut_by(0, 2, 11008, &[range(2752, 2752)]).unwrap();
        assert!(
            why.contains("2752..5504 of 11008") && why.contains("scale blocks of 128"),
            "{why}"
        );
        // The dim's last block may be partial: 300 rows end inside a block of 128 but at
        // the dim's end.
        assert!(q.cut_by(0, 2, 300, &[range(256, 44)]).is_none());
        assert!(q.cut_by(0, 2, 300, &[range(250, 50)]).is_some());
        // Along the other dim, with its own block.
        let q = fp8([128, 64]);
        assert!(q.cut_by(1, 2, 256, &[range(64, 64)]).is_none());
        assert!(q.cut_by(0, 2, 256, &[range(64, 64)]).is_some());
        // A stack of experts `[experts, out, in]`: its experts dim has no blocks, the others
        // are the experts' own.
        assert!(q.cut_by(0, 3, 8, &[range(3, 2)]).is_none());
        assert!(q.cut_by(1, 3, 256, &[range(64, 64)]).is_some());
        assert!(q.cut_by(2, 3, 256, &[range(64, 64)]).is_none());
    }

    #[test]
    fn stored_bytes_count_one_byte_an_element_and_a_scale_a_block() {
        let q = fp8([128, 128]);
        // 256 × 300: 2 × 3 blocks.
        assert_eq!(q.stored_bytes(&[256, 300]), 256 * 300 + 6 * 4);
        assert_eq!(q.scale_shape(&[256, 300]), Some([2, 3]));
        // Three experts' pieces: each its own scales.
        assert_eq!(q.stored_bytes(&[3, 256, 300]), 3 * (256 * 300 + 6 * 4));
        assert_eq!(q.scale_shape(&[256]), None);
    }

    #[test]
    fn a_scale_per_channel_takes_any_cut_of_the_inputs() {
        let q = Quantized {
            format: QuantFormat::Int8,
            block: [1, 0],
            act_order: false,
        };
        assert_eq!(q.scale_shape(&[256, 300]), Some([256, 1]));
        assert_eq!(q.stored_bytes(&[256, 300]), 256 * 300 + 256 * 4);
        assert_eq!(q.column_scaled_bytes(&[256, 300]), 256 * 300 + 256 * 4);
        assert!(q.cut_by(1, 2, 300, &[range(7, 100)]).is_none());
        assert!(q.cut_by(0, 2, 256, &[range(3, 100)]).is_none());
        assert_eq!(describe_block(q.block), "output channel");
        assert_eq!(describe_block([128, 64]), "128 × 64 block");
        assert_eq!(describe_block([1, 32]), "group of 32 inputs of an output");
    }

    #[test]
    fn int4_splits_keep_groups_and_words_whole() {
        let gptq = Quantized {
            format: QuantFormat::Int4Gptq,
            block: [1, 32],
            act_order: false,
        };
        // Outputs: the zeros pack eight to a word.
        assert!(gptq.cut_by(0, 2, 64, &[range(16, 16)]).is_none());
        let why = gptq.cut_by(0, 2, 64, &[range(12, 12)]).unwrap();
        assert!(why.contains("int4 gptq packed words of 8"), "{why}");
        // Inputs: groups of 32.
        assert!(gptq.cut_by(1, 2, 128, &[range(32, 32)]).is_none());
        let why = gptq.cut_by(1, 2, 128, &[range(16, 16)]).unwrap();
        assert!(why.contains("int4 gptq scale groups of 32"), "{why}");
        // Act order: groups lie anywhere, the weight's words of eight inputs still bind.
        let act = Quantized {
            act_order: true,
            ..gptq
        };
        assert!(act.cut_by(1, 2, 128, &[range(16, 16)]).is_none());
        assert!(act.cut_by(1, 2, 128, &[range(4, 4)]).is_some());
        // AWQ packs its weights along the outputs: any whole group of inputs, words of
        // eight outputs.
        let awq = Quantized {
            format: QuantFormat::Int4Awq,
            ..gptq
        };
        let why = awq.cut_by(1, 2, 128, &[range(16, 16)]).unwrap();
        assert!(why.contains("int4 awq scale groups of 32"), "{why}");
        assert!(awq.cut_by(0, 2, 64, &[range(4, 4)]).is_some());
        // One group across the inputs (group size -1): only the words bind.
        let channel = Quantized {
            block: [1, 0],
            ..gptq
        };
        assert!(channel.cut_by(1, 2, 128, &[range(8, 8)]).is_none());
        assert!(channel.cut_by(1, 2, 128, &[range(4, 4)]).is_some());
        // Half a byte an element, an f16 scale and a 4-bit zero per group per output, and a
        // g_idx entry per input: 64 × 128 in groups of 32.
        assert_eq!(
            gptq.stored_bytes(&[64, 128]),
            64 * 128 / 2 + 64 * 4 * 5 / 2 + 128 * 4
        );
        assert_eq!(awq.stored_bytes(&[64, 128]), 64 * 128 / 2 + 64 * 4 * 5 / 2);
        // compressed-tensors: symmetric stores no zeros, act order a g_idx entry per input;
        // inputs packed as GPTQ's, so the same atoms.
        let sym = Quantized {
            format: QuantFormat::Int4Packed { zero_points: false },
            ..gptq
        };
        assert_eq!(sym.stored_bytes(&[64, 128]), 64 * 128 / 2 + 64 * 4 * 2);
        let asym_act = Quantized {
            format: QuantFormat::Int4Packed { zero_points: true },
            act_order: true,
            ..gptq
        };
        assert_eq!(
            asym_act.stored_bytes(&[64, 128]),
            64 * 128 / 2 + 64 * 4 * 5 / 2 + 128 * 4
        );
        let why = sym.cut_by(1, 2, 128, &[range(16, 16)]).unwrap();
        assert!(
            why.contains("int4 pack-quantized symmetric scale groups of 32"),
            "{why}"
        );
        assert!(sym.cut_by(0, 2, 64, &[range(4, 4)]).is_some());
        assert!(asym_act.cut_by(1, 2, 128, &[range(16, 16)]).is_none());
        assert!(!sym.describe().contains("zero") && asym_act.describe().contains("zero"));
        // Held by the CPU runtime: the codes, and an f32 scale and zero per group per output.
        assert_eq!(
            gptq.column_scaled_bytes(&[64, 128]),
            64 * 128 / 2 + 64 * 4 * 8
        );
        // In act order the codes sorted by group, and their order.
        let act = Quantized {
            act_order: true,
            ..gptq
        };
        assert_eq!(
            act.column_scaled_bytes(&[64, 128]),
            64 * 128 / 2 + 64 * 4 * 8 + 128 * 8
        );
    }

    #[test]
    fn modules_left_unquantized_match_by_prefix_or_suffix() {
        let q = Quantization {
            format: QuantFormat::Fp8E4m3,
            block: [128, 128],
            scales: ScaleNames::ScaleInv,
            modules_to_not_convert: vec!["lm_head".into(), "model.layers.0.mlp".into()],
            act_order: false,
        };
        assert!(!q.covers("lm_head.weight"));
        // A suffix names a module in every layer (HF's `endswith`).
        let gate = Quantization {
            modules_to_not_convert: vec!["mlp.gate".into()],
            ..q.clone()
        };
        assert!(!gate.covers("model.layers.3.mlp.gate.weight"));
        assert!(gate.covers("model.layers.3.mlp.gate_proj.weight"));
        assert!(!q.covers("model.layers.0.mlp.down_proj.weight"));
        assert!(q.covers("model.layers.10.mlp.down_proj.weight"));
        assert!(q.covers("model.layers.0.self_attn.q_proj.weight"));
        assert_eq!(q.for_weight(1).block, [128, 128]);
        let q = Quantization {
            block: [64, 32],
            ..q
        };
        assert_eq!(q.for_weight(0).block, [64, 32]);
        assert_eq!(q.for_weight(1).block, [32, 64]);
    }
}

//! What a model file says: a family preset with HF-like hyper-parameters, or an explicit
//! graph of named ops with a repeat over layers.

use crate::error::{Result, TpcError};
use crate::ir::{ActivationKind, DType, ExpertSplit, Groups, Op, Quantization, RopeScaling};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ModelDef {
    Preset(FamilyConfig),
    Graph(GraphDef),
}

impl ModelDef {
    /// The model's `tp_plan` overrides; a mixture-of-experts preset's routers are
    /// replicated unless the model says otherwise (their logits are small, and the softmax
    /// over the experts needs them whole).
    pub fn tp_plan(&self) -> std::borrow::Cow<'_, BTreeMap<String, TpWord>> {
        match self {
            ModelDef::Preset(p) => match p.replicated_patterns() {
                [] => std::borrow::Cow::Borrowed(&p.tp_plan),
                patterns => {
                    let mut plan = p.tp_plan.clone();
                    for &pattern in patterns {
                        plan.entry(pattern.into()).or_insert(TpWord::Replicate);
                    }
                    std::borrow::Cow::Owned(plan)
                }
            },
            ModelDef::Graph(g) => std::borrow::Cow::Borrowed(&g.tp_plan),
        }
    }

    /// The longest sequence (prompt + generated tokens) the model is defined for, when the
    /// definition says (GPT-2's learned positions end at `n_positions`, 1024 by default).
    pub fn max_positions(&self) -> Option<u64> {
        match self {
            ModelDef::Preset(p) => p.max_positions(),
            ModelDef::Graph(g) => g.max_position_embeddings,
        }
    }

    /// The model with its mixture-of-experts layers split as `split` says (`--moe`); a
    /// model without experts is refused, so that the flag never goes unheard.
    pub fn with_expert_split(&self, split: ExpertSplit) -> Result<ModelDef> {
        let mut def = self.clone();
        let found = match &mut def {
            ModelDef::Preset(p) => p.moe.as_mut().map(|m| m.split = split).is_some(),
            ModelDef::Graph(g) => {
                let mut found = false;
                let mut visit = |body: &mut Vec<Stmt>| {
                    for stmt in body {
                        if let Stmt::Node(NodeDef {
                            op: Op::Experts(e), ..
                        }) = stmt
                        {
                            e.split = split;
                            found = true;
                        }
                    }
                };
                visit(&mut g.body);
                for stmt in &mut g.body {
                    if let Stmt::Repeat(r) = stmt {
                        visit(&mut r.body);
                    }
                }
                found
            }
        };
        if !found {
            let model = match self {
                ModelDef::Preset(p) => p.name.clone().unwrap_or_else(|| format!("{:?}", p.family)),
                ModelDef::Graph(g) => g.name.clone(),
            };
            return Err(TpcError::Model {
                model,
                place: "--moe".into(),
                message: format!(
                    "`--moe {}` splits mixture-of-experts layers, and this model has none; drop --moe",
                    split.word()
                ),
            });
        }
        Ok(def)
    }

    /// The attention window (Mistral's `sliding_window`) when it limits the context.
    pub fn sliding_window(&self) -> Option<u64> {
        match self {
            ModelDef::Preset(p) => p.sliding_window,
            ModelDef::Graph(g) => g.sliding_window,
        }
    }

    /// Refuses to execute a sequence of `tokens` positions (prompt + generated) that tpc's
    /// runtime would compute differently from the model: with a sliding window, attention
    /// past the window differs from the full causal attention the runtime has.
    pub fn check_executable(&self, tokens: u64) -> Result<()> {
        let model = match self {
            ModelDef::Preset(p) => p.name.clone().unwrap_or_else(|| format!("{:?}", p.family)),
            ModelDef::Graph(g) => g.name.clone(),
        };
        match self.sliding_window() {
            Some(window) if tokens > window => Err(window_error(model, window, tokens)),
            _ => Ok(()),
        }
    }
}

/// A sequence longer than the model's attention window.
pub fn window_error(model: String, window: u64, tokens: u64) -> TpcError {
    TpcError::Model {
        model,
        place: "sliding_window".into(),
        message: format!(
            "each token attends to the last {window} positions only, and tpc's runtime has full causal attention, which computes something else once a sequence is longer than {window} tokens; this one has {tokens} (prompt + new tokens). Keep the prompt plus --max-new-tokens at most {window} (compiling is not affected)"
        ),
    }
}

/// The architectures tpc has presets for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Family {
    /// Llama 2/3/3.1 and Mistral dense.
    Llama,
    /// Qwen2: q/k/v projections with bias.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k, explicit head_dim.
    Qwen3,
    /// GPT-2: LayerNorm, learned positions, Conv1D weights, fused c_attn, tied head.
    Gpt2,
    /// GPT-NeoX / Pythia: parallel residual, partial rotary, per-head fused qkv.
    GptNeox,
    /// Mixtral: Llama attention, a mixture of experts (`block_sparse_moe`) in every layer.
    Mixtral,
    /// Qwen3-MoE: Qwen3 attention, a mixture of experts (`mlp`) in the sparse layers and a
    /// dense MLP in the others.
    Qwen3Moe,
    /// Qwen2-MoE: Qwen2 attention (q/k/v bias), routed experts plus a shared expert scaled
    /// by a sigmoid gate, dense MLPs where Qwen3-MoE would have them.
    Qwen2Moe,
    /// OLMoE: Llama attention whose q and k are RMS-normalised over the whole projection
    /// (not per head), a mixture of experts in every layer.
    Olmoe,
}

impl Family {
    /// Whether the family's layers hold a mixture of experts.
    pub fn is_moe(self) -> bool {
        matches!(
            self,
            Family::Mixtral | Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe
        )
    }
}

/// A mixture-of-experts model's experts, as HF configs name them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per layer (`num_local_experts` / `num_experts`).
    pub num_experts: u64,
    /// Experts each token is routed to.
    pub num_experts_per_tok: u64,
    /// Each expert's features; `intermediate_size` when absent (Mixtral).
    #[serde(default)]
    pub moe_intermediate_size: Option<u64>,
    /// Whether the chosen experts' weights are divided by their sum.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Layers with a dense MLP instead of experts (Qwen3-MoE's `mlp_only_layers`).
    #[serde(default)]
    pub mlp_only_layers: Vec<u64>,
    /// Every this many layers is sparse (layer `i` when `(i + 1) % step == 0`); 1: all.
    #[serde(default)]
    pub decoder_sparse_step: Option<u64>,
    /// The shared expert's features (Qwen2-MoE: every token goes through it, scaled by
    /// `shared_expert_gate`); `None` where the family has no shared expert.
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<u64>,
    /// How the sharding pass splits the experts (`--moe`).
    #[serde(default)]
    pub split: ExpertSplit,
}

impl MoeConfig {
    /// Whether layer `i` holds experts (transformers' rule for Qwen-MoE layers).
    pub fn is_sparse(&self, layer: u64) -> bool {
        let step = self.decoder_sparse_step.unwrap_or(1);
        !self.mlp_only_layers.contains(&layer) && step > 0 && (layer + 1).is_multiple_of(step)
    }
}

/// HF tensor-parallel plan words for per-weight overrides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TpWord {
    Colwise,
    Rowwise,
    Vocab,
    Replicate,
}

impl TpWord {
    pub fn word(self) -> &'static str {
        match self {
            TpWord::Colwise => "colwise",
            TpWord::Rowwise => "rowwise",
            TpWord::Vocab => "vocab",
            TpWord::Replicate => "replicate",
        }
    }
}

impl FamilyConfig {
    /// The `tp_plan` patterns of a mixture-of-experts family's weights that every rank
    /// holds whole: the router (it needs every expert's logit) and a shared expert's gate
    /// (one output).
    pub fn replicated_patterns(&self) -> &'static [&'static str] {
        match self.family {
            Family::Mixtral => &["model.layers.*.block_sparse_moe.gate.weight"],
            Family::Qwen3Moe | Family::Olmoe => &["model.layers.*.mlp.gate.weight"],
            Family::Qwen2Moe => &[
                "model.layers.*.mlp.gate.weight",
                "model.layers.*.mlp.shared_expert_gate.weight",
            ],
            _ => &[],
        }
    }

    /// `max_position_embeddings`, or the family's default where it has a hard one (GPT-2's
    /// learned positions: 1024).
    pub fn max_positions(&self) -> Option<u64> {
        self.max_position_embeddings
            .or((self.family == Family::Gpt2).then_some(1024))
    }
}

/// Family preset. Names follow HF `config.json`; unset options take the family's default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FamilyConfig {
    pub family: Family,
    #[serde(default)]
    pub name: Option<String>,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub num_hidden_layers: u64,
    pub num_attention_heads: u64,
    #[serde(default)]
    pub num_key_value_heads: Option<u64>,
    #[serde(default)]
    pub head_dim: Option<u64>,
    pub vocab_size: u64,
    #[serde(default)]
    pub max_position_embeddings: Option<u64>,
    #[serde(default)]
    pub norm_eps: Option<f64>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Fraction of each head that is rotated (GPT-NeoX `rotary_pct`).
    #[serde(default)]
    pub rotary_pct: Option<f64>,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub use_parallel_residual: Option<bool>,
    #[serde(default)]
    pub hidden_act: Option<ActivationKind>,
    /// Sliding-window attention (Mistral): each token sees only the last `sliding_window`
    /// positions. Kept only when smaller than the context. The split does not depend on it,
    /// so compiling works; tpc's runtime has full causal attention only, which is the same
    /// computation up to the window, so longer sequences are refused ([`ModelDef::check_executable`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    #[serde(default = "default_dtype")]
    pub dtype: DType,
    /// Overrides: weight name pattern (`*` matches one dotted segment) → HF tp_plan word.
    #[serde(default)]
    pub tp_plan: BTreeMap<String, TpWord>,
    /// The experts of a mixture-of-experts family (required there, refused elsewhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<Box<MoeConfig>>,
    /// How the checkpoint stores its linear weights when it is quantized (HF
    /// `quantization_config`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<Quantization>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

pub fn default_dtype() -> DType {
    DType::Bf16
}

/// An explicit graph: statements in order; names are bound once and referenced later.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GraphDef {
    pub name: String,
    #[serde(default = "default_dtype")]
    pub dtype: DType,
    pub body: Vec<Stmt>,
    #[serde(default)]
    pub tp_plan: BTreeMap<String, TpWord>,
    /// The longest sequence the model is defined for (prompt + generated tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_position_embeddings: Option<u64>,
    /// Each token attends to this many positions at most (Mistral's `sliding_window`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    /// How the checkpoint stores the linear weights when it is quantized: every linear's
    /// weight but the output head's and those it names as left unconverted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<Quantization>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Stmt {
    /// A checkpoint tensor, bound under its own name.
    Weight(WeightDef),
    /// An op applied to earlier names.
    Node(NodeDef),
    /// The body once per layer; `{i}` in names becomes the layer index.
    Repeat(RepeatDef),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightDef {
    pub name: String,
    pub shape: Vec<u64>,
    #[serde(default)]
    pub dtype: Option<DType>,
    #[serde(default)]
    pub groups: BTreeMap<u32, Groups>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeDef {
    pub name: String,
    pub op: Op,
    #[serde(default)]
    pub inputs: Vec<String>,
}

/// `count` layers. Inside the body, the name `carry` means `init` in layer 0 and the
/// previous layer's `result` after that; after the loop it means the last layer's result.
/// Layers are numbered from `start` (several repeats in a row make a model whose layers
/// differ, such as dense layers among mixture-of-experts ones).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepeatDef {
    pub count: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub start: u64,
    pub carry: String,
    pub init: String,
    pub result: String,
    pub body: Vec<Stmt>,
}

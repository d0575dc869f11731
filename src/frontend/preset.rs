//! Family presets lowered to explicit graphs, with the checkpoint's own tensor names.
//! Every preset goes through the same graph builder as hand-written graphs.

use super::spec::*;
use super::validate::{MAX_DIM, MAX_LAYERS};
use crate::error::{Result, TpcError};
use crate::ir::*;
use std::collections::BTreeMap;

/// Appends statements; each weight is declared right before its first use.
#[derive(Default, Clone)]
struct Emit {
    body: Vec<Stmt>,
}

impl Emit {
    fn weight(&mut self, name: &str, shape: &[u64], groups: &[(u32, Groups)]) -> String {
        self.body.push(Stmt::Weight(WeightDef {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype: None,
            groups: groups.iter().cloned().collect::<BTreeMap<_, _>>(),
        }));
        name.to_string()
    }

    fn node(&mut self, name: &str, op: Op, inputs: &[&str]) -> String {
        self.body.push(Stmt::Node(NodeDef {
            name: name.to_string(),
            op,
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
        }));
        name.to_string()
    }

    /// `name = x · W (+ b)`; `w_groups`/`b_groups` describe the weight's and bias's dims.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &mut self,
        name: &str,
        x: &str,
        order: WeightOrder,
        (inp, out): (u64, u64),
        out_groups: Option<Groups>,
        in_groups: Option<Groups>,
        bias: bool,
    ) -> String {
        let shape = match order {
            WeightOrder::OutIn => [out, inp],
            WeightOrder::InOut => [inp, out],
        };
        let mut groups = Vec::new();
        if let Some(g) = &out_groups {
            groups.push((order.out_dim(), g.clone()));
        }
        if let Some(g) = in_groups {
            groups.push((order.in_dim(), g));
        }
        let w = self.weight(&format!("{name}.weight"), &shape, &groups);
        let y = self.node(
            name,
            Op::Linear(LinearOp {
                weight_order: order,
                exact: None,
            }),
            &[x, &w],
        );
        if !bias {
            return y;
        }
        let bg: Vec<_> = out_groups.into_iter().map(|g| (0, g)).collect();
        let b = self.weight(&format!("{name}.bias"), &[out], &bg);
        self.node(
            &format!("{name}.add_bias"),
            Op::BiasAdd(BiasAddOp {}),
            &[&y, &b],
        )
    }

    fn rms_norm(
        &mut self,
        name: &str,
        x: &str,
        width: u64,
        eps: f64,
        group: Option<u64>,
    ) -> String {
        let w = self.weight(&format!("{name}.weight"), &[width], &[]);
        let op = Op::RmsNorm(RmsNormOp {
            eps: F64(eps),
            group,
            reduce_input: None,
            with_reduce: false,
        });
        self.node(name, op, &[x, &w])
    }

    fn layer_norm(&mut self, name: &str, x: &str, width: u64, eps: f64) -> String {
        let w = self.weight(&format!("{name}.weight"), &[width], &[]);
        let b = self.weight(&format!("{name}.bias"), &[width], &[]);
        self.node(
            name,
            Op::LayerNorm(LayerNormOp { eps: F64(eps) }),
            &[x, &w, &b],
        )
    }

    fn embedding(&mut self, name: &str, ids: &str, rows: u64, width: u64) -> String {
        let w = self.weight(
            &format!("{name}.weight"),
            &[rows, width],
            &[(0, Groups::Plain { padded: true })],
        );
        self.node(name, Op::Embedding(EmbeddingOp::default()), &[ids, &w])
    }
}

/// Hyper-parameters after family defaults are applied.
struct Dims {
    h: u64,
    ffn: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    vocab: u64,
    eps: f64,
    tie: bool,
    bias: bool,
    act: ActivationKind,
}

/// Query heads (and o_proj's input) by their key/value groups (a multi-head family's
/// heads are each their own group), so that a tp may deal them unevenly (`Groups::Heads`).
fn heads(count: u64, size: u64, kv_groups: Option<u64>) -> Groups {
    Groups::Heads {
        count,
        size,
        replicable: false,
        kv_groups,
    }
}

fn kv_heads(count: u64, size: u64) -> Groups {
    Groups::Heads {
        count,
        size,
        replicable: true,
        kv_groups: Some(count),
    }
}

fn model_name(c: &FamilyConfig) -> String {
    c.name
        .clone()
        .unwrap_or_else(|| format!("{:?}", c.family).to_lowercase())
}

fn check_dims(c: &FamilyConfig) -> Result<Dims> {
    let name = model_name(c);
    let bad = |message: String| TpcError::Model {
        model: name.clone(),
        place: "preset".into(),
        message,
    };
    for (field, v) in [
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("num_hidden_layers", c.num_hidden_layers),
        ("num_attention_heads", c.num_attention_heads),
        ("vocab_size", c.vocab_size),
    ] {
        if v == 0 {
            return Err(bad(format!("{field} must be positive")));
        }
        let limit = if field == "num_hidden_layers" {
            MAX_LAYERS
        } else {
            MAX_DIM
        };
        if v > limit {
            return Err(bad(format!(
                "{field} is {v}; tpc's limit is {limit} (checked before anything is built)"
            )));
        }
    }
    for (field, v) in [
        ("num_key_value_heads", c.num_key_value_heads),
        ("head_dim", c.head_dim),
    ] {
        if v.is_some_and(|v| v > MAX_DIM) {
            return Err(bad(format!("{field} is {v:?}; tpc's limit is {MAX_DIM}")));
        }
    }
    for (field, v) in [("norm_eps", c.norm_eps), ("rope_theta", c.rope_theta)] {
        if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(bad(format!(
                "{field} is {v}; it must be a finite number above 0"
            )));
        }
    }
    if let Some(scaling) = &c.rope_scaling {
        super::validate::check_rope_scaling(scaling)
            .map_err(|m| bad(format!("rope_scaling: {m}")))?;
    }
    let heads = c.num_attention_heads;
    let kv = c.num_key_value_heads.unwrap_or(heads);
    if kv == 0 || !heads.is_multiple_of(kv) {
        return Err(bad(format!(
            "num_attention_heads {heads} must be a multiple of num_key_value_heads {kv}"
        )));
    }
    let head_dim = match c.head_dim {
        Some(d) if d > 0 => d,
        Some(_) => return Err(bad("head_dim must be positive".into())),
        // transformers' Qwen3Config default, independent of hidden_size.
        None if c.family == Family::Qwen3 => 128,
        None if c.hidden_size.is_multiple_of(heads) => c.hidden_size / heads,
        None => {
            return Err(bad(format!(
                "hidden_size {} is not a multiple of num_attention_heads {heads}; set head_dim",
                c.hidden_size
            )))
        }
    };
    if head_dim % 2 != 0 && c.family != Family::Gpt2 {
        return Err(bad(format!(
            "head_dim {head_dim} must be even for rotary embeddings"
        )));
    }
    let (default_eps, default_bias, default_tie, default_act) = match c.family {
        Family::Llama => (1e-6, false, false, ActivationKind::Silu),
        Family::Qwen2 => (1e-6, true, false, ActivationKind::Silu),
        Family::Qwen3 => (1e-6, false, false, ActivationKind::Silu),
        Family::Gpt2 => (1e-5, true, true, ActivationKind::GeluTanh),
        Family::GptNeox => (1e-5, true, false, ActivationKind::Gelu),
        Family::Mixtral | Family::Qwen3Moe => (1e-6, false, false, ActivationKind::Silu),
        Family::Qwen2Moe => (1e-6, true, false, ActivationKind::Silu),
        Family::Olmoe => (1e-5, false, false, ActivationKind::Silu),
    };
    match (&c.moe, c.family.is_moe()) {
        (None, true) => {
            return Err(bad(format!(
                "a {:?} model needs `moe` (its experts: num_experts, num_experts_per_tok)",
                c.family
            )))
        }
        (Some(_), false) => {
            return Err(bad(format!(
                "`moe` is set, but {:?} has no mixture-of-experts layers; use a mixture-of-experts family (Mixtral, Qwen2Moe, Qwen3Moe, Olmoe) or remove it",
                c.family
            )))
        }
        (Some(m), true) => check_moe(m).map_err(bad)?,
        (None, false) => {}
    }
    if c.family == Family::Gpt2 && c.tie_word_embeddings == Some(false) {
        return Err(bad(
            "GPT-2 always ties its LM head to wte; remove tie_word_embeddings: false".into(),
        ));
    }
    Ok(Dims {
        h: c.hidden_size,
        ffn: c.intermediate_size,
        layers: c.num_hidden_layers,
        heads,
        kv_heads: kv,
        head_dim,
        vocab: c.vocab_size,
        eps: c.norm_eps.unwrap_or(default_eps),
        tie: c.tie_word_embeddings.unwrap_or(default_tie),
        bias: c.attention_bias.unwrap_or(default_bias),
        act: c.hidden_act.unwrap_or(default_act),
    })
}

/// The experts' counts fit: at least one expert, each token routed to 1 to all of them.
fn check_moe(m: &MoeConfig) -> std::result::Result<(), String> {
    if m.num_experts == 0 || m.num_experts > MAX_DIM {
        return Err(format!(
            "num_experts is {}; it must be 1 to {MAX_DIM}",
            m.num_experts
        ));
    }
    if m.num_experts_per_tok == 0 || m.num_experts_per_tok > m.num_experts {
        return Err(format!(
            "num_experts_per_tok is {}; each token is routed to 1 to the {} experts there are",
            m.num_experts_per_tok, m.num_experts
        ));
    }
    for (name, size) in [
        ("moe_intermediate_size", m.moe_intermediate_size),
        (
            "shared_expert_intermediate_size",
            m.shared_expert_intermediate_size,
        ),
    ] {
        match size {
            Some(0) => return Err(format!("{name} must be positive")),
            Some(f) if f > MAX_DIM => {
                return Err(format!("{name} is {f}; tpc's limit is {MAX_DIM}"))
            }
            _ => {}
        }
    }
    Ok(())
}

fn rope_op(c: &FamilyConfig, d: &Dims) -> Result<Op> {
    // transformers' GPTNeoXConfig rotates a quarter of each head by default.
    let default_pct = if c.family == Family::GptNeox {
        0.25
    } else {
        1.0
    };
    let pct = c.rotary_pct.unwrap_or(default_pct);
    // transformers truncates: `int(head_size * rotary_pct)`.
    let rotary = (d.head_dim as f64 * pct) as u64;
    if !(pct > 0.0 && pct <= 1.0 && rotary.is_multiple_of(2)) || rotary == 0 {
        return Err(TpcError::Model {
            model: model_name(c),
            place: "preset".into(),
            message: format!(
                "rotary_pct {pct} of head_dim {} gives {rotary} rotary dims; it must be in (0, 1] and give an even count",
                d.head_dim
            ),
        });
    }
    Ok(Op::Rope(RopeOp {
        head_dim: d.head_dim,
        rotary_dim: rotary,
        theta: F64(c.rope_theta.unwrap_or(10000.0)),
        scaling: c.rope_scaling.clone(),
    }))
}

/// Lowers a family preset to the explicit graph form.
pub fn lower_preset(c: &FamilyConfig) -> Result<GraphDef> {
    let d = check_dims(c)?;
    let mut pre = Emit::default();
    pre.node(
        "input_ids",
        Op::Input(InputOp {
            kind: InputKind::TokenIds,
        }),
        &[],
    );
    pre.node(
        "positions",
        Op::Input(InputOp {
            kind: InputKind::Positions,
        }),
        &[],
    );
    let (layer, init, result, post) = match c.family {
        Family::Llama
        | Family::Qwen2
        | Family::Qwen3
        | Family::Mixtral
        | Family::Qwen3Moe
        | Family::Qwen2Moe
        | Family::Olmoe => llama_like(c, &d, &mut pre)?,
        Family::Gpt2 => gpt2(c, &d, &mut pre)?,
        Family::GptNeox => gpt_neox(c, &d, &mut pre)?,
    };
    let mut body = pre.body;
    // Runs of layers alike, one repeat each: every layer the same, or a mixture-of-experts
    // model's sparse and dense layers.
    let mut start = 0;
    let mut init = init;
    while start < d.layers {
        let sparse =
            |i: u64| layer.sparse.is_some() && c.moe.as_ref().is_some_and(|m| m.is_sparse(i));
        let kind = sparse(start);
        let count = (start..d.layers).take_while(|&i| sparse(i) == kind).count() as u64;
        let body_of = match (&layer.sparse, kind) {
            (Some(s), true) => s,
            _ => &layer.dense,
        };
        body.push(Stmt::Repeat(RepeatDef {
            count,
            start,
            carry: "hidden".into(),
            init: init.clone(),
            result: result.clone(),
            body: body_of.body.clone(),
        }));
        init = "hidden".into();
        start += count;
    }
    body.extend(post.body);
    Ok(GraphDef {
        name: model_name(c),
        dtype: c.dtype,
        body,
        tp_plan: c.tp_plan.clone(),
        max_position_embeddings: c.max_positions(),
        sliding_window: c.sliding_window,
        quantization: c.quantization.clone(),
    })
}

/// One decoder layer (and a mixture-of-experts model's sparse one), the carried value's
/// init and result names, and the epilogue.
type Lowered = (Layer, String, String, Emit);

struct Layer {
    dense: Emit,
    sparse: Option<Emit>,
}

impl From<Emit> for Layer {
    fn from(dense: Emit) -> Layer {
        Layer {
            dense,
            sparse: None,
        }
    }
}

fn llama_like(c: &FamilyConfig, d: &Dims, pre: &mut Emit) -> Result<Lowered> {
    let embed = pre.embedding("model.embed_tokens", "input_ids", d.vocab, d.h);
    let rope = rope_op(c, d)?;
    let (hd, q_out, kv_out) = (d.head_dim, d.heads * d.head_dim, d.kv_heads * d.head_dim);
    let mut l = Emit::default();
    let p = "model.layers.{i}";
    let x = l.rms_norm(&format!("{p}.input_layernorm"), "hidden", d.h, d.eps, None);
    let proj = |l: &mut Emit, name: &str, out: u64, g: Groups| {
        let mut y = l.linear(
            &format!("{p}.self_attn.{name}_proj"),
            &x,
            WeightOrder::OutIn,
            (d.h, out),
            Some(g),
            None,
            d.bias,
        );
        if matches!(c.family, Family::Qwen3 | Family::Qwen3Moe) && name != "v" {
            y = l.rms_norm(
                &format!("{p}.self_attn.{name}_norm"),
                &y,
                hd,
                d.eps,
                Some(hd),
            );
        }
        // OLMoE normalises the whole projection: its statistics span every head, so the
        // sharding pass gathers the heads before the norm and slices them after.
        if c.family == Family::Olmoe && name != "v" {
            y = l.rms_norm(&format!("{p}.self_attn.{name}_norm"), &y, out, d.eps, None);
        }
        if name != "v" {
            y = l.node(
                &format!("{p}.self_attn.{name}_rope"),
                rope.clone(),
                &[&y, "positions"],
            );
        }
        y
    };
    let q = proj(&mut l, "q", q_out, heads(d.heads, hd, Some(d.kv_heads)));
    let k = proj(&mut l, "k", kv_out, kv_heads(d.kv_heads, hd));
    let v = proj(&mut l, "v", kv_out, kv_heads(d.kv_heads, hd));
    let attn_op = Op::Attention(AttentionOp {
        head_dim: hd,
        scale: None,
    });
    let a = l.node(&format!("{p}.self_attn.attn"), attn_op, &[&q, &k, &v]);
    let o = l.linear(
        &format!("{p}.self_attn.o_proj"),
        &a,
        WeightOrder::OutIn,
        (q_out, d.h),
        None,
        Some(heads(d.heads, hd, Some(d.kv_heads))),
        d.bias && !matches!(c.family, Family::Qwen2 | Family::Qwen2Moe),
    );
    let h1 = l.node(
        &format!("{p}.attn_residual"),
        Op::Add(AddOp {}),
        &["hidden", &o],
    );
    let x2 = l.rms_norm(
        &format!("{p}.post_attention_layernorm"),
        &h1,
        d.h,
        d.eps,
        None,
    );
    let sparse = c.moe.as_ref().map(|m| {
        let mut s = l.clone();
        let (block, names) = match c.family {
            Family::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        };
        let prefix = format!("{p}.{block}");
        let mut moe = experts_block(&mut s, &prefix, &x2, d, m, names);
        if let Some(f) = m.shared_expert_intermediate_size {
            moe = shared_expert(&mut s, &prefix, &x2, &moe, d, f);
        }
        s.node(
            &format!("{p}.mlp_residual"),
            Op::Add(AddOp {}),
            &[&h1, &moe],
        );
        s
    });
    let down = gated_mlp(&mut l, &format!("{p}.mlp"), &x2, d, d.ffn);
    let result = l.node(
        &format!("{p}.mlp_residual"),
        Op::Add(AddOp {}),
        &[&h1, &down],
    );

    let mut post = Emit::default();
    let n = post.rms_norm("model.norm", "hidden", d.h, d.eps, None);
    lm_head(&mut post, d, &n, "model.embed_tokens.weight", "lm_head");
    let layer = Layer { dense: l, sparse };
    Ok((layer, embed, result, post))
}

/// `down(act(gate · x) ⊙ up · x)` with `ffn` features, weights `prefix.{gate,up,down}_proj`.
/// Returns the down projection's output.
fn gated_mlp(l: &mut Emit, prefix: &str, x: &str, d: &Dims, ffn: u64) -> String {
    let proj = |l: &mut Emit, name: &str| {
        let n = format!("{prefix}.{name}_proj");
        l.linear(&n, x, WeightOrder::OutIn, (d.h, ffn), None, None, false)
    };
    let gate = proj(l, "gate");
    let act = l.node(
        &format!("{prefix}.act"),
        Op::Activation(ActivationOp { kind: d.act }),
        &[&gate],
    );
    let up = proj(l, "up");
    let m = l.node(
        &format!("{prefix}.gate_up"),
        Op::Mul(MulOp {}),
        &[&act, &up],
    );
    l.linear(
        &format!("{prefix}.down_proj"),
        &m,
        WeightOrder::OutIn,
        (ffn, d.h),
        None,
        None,
        false,
    )
}

/// Qwen2-MoE's shared expert beside the routed ones: a gated MLP of `ffn` features every
/// token goes through, scaled by `σ(shared_expert_gate · x)` and added to the routed
/// experts' output `routed`. Both are partial sums under tp, so the layer keeps its one
/// all-reduce.
fn shared_expert(l: &mut Emit, prefix: &str, x: &str, routed: &str, d: &Dims, ffn: u64) -> String {
    let out = gated_mlp(l, &format!("{prefix}.shared_expert"), x, d, ffn);
    let logit = l.linear(
        &format!("{prefix}.shared_expert_gate"),
        x,
        WeightOrder::OutIn,
        (d.h, 1),
        None,
        None,
        false,
    );
    let gated = l.node(
        &format!("{prefix}.shared_expert_gated"),
        Op::SigmoidGate(SigmoidGateOp {}),
        &[&out, &logit],
    );
    l.node(
        &format!("{prefix}.with_shared_expert"),
        Op::Add(AddOp {}),
        &[routed, &gated],
    )
}

/// A mixture-of-experts block at `prefix` reading `x`: the router (`prefix.gate`, a linear
/// to one logit per expert, then the top-k choice) and the experts, whose weights are
/// stacks of the checkpoint's per-expert tensors (`prefix.experts.{e}.<name>.weight`,
/// `names` = gate, up, down). Returns the block's output.
fn experts_block(
    l: &mut Emit,
    prefix: &str,
    x: &str,
    d: &Dims,
    m: &MoeConfig,
    names: [&str; 3],
) -> String {
    let e = m.num_experts;
    let f = m.moe_intermediate_size.unwrap_or(d.ffn);
    let router = l.linear(
        &format!("{prefix}.gate"),
        x,
        WeightOrder::OutIn,
        (d.h, e),
        None,
        None,
        false,
    );
    let routing = l.node(
        &format!("{prefix}.route"),
        Op::Route(RouteOp {
            top_k: m.num_experts_per_tok,
            normalize: m.norm_topk_prob,
        }),
        &[&router],
    );
    // Each expert is an atom of the experts dim: dealt whole, unevenly where tp does not
    // divide the count.
    let experts = Groups::Heads {
        count: e,
        size: 1,
        replicable: false,
        kv_groups: Some(e),
    };
    let stack = |l: &mut Emit, name: &str, shape: [u64; 3]| {
        l.weight(
            &format!("{prefix}.experts.{{e}}.{name}.weight"),
            &shape,
            &[(0, experts.clone())],
        )
    };
    let gate = stack(l, names[0], [e, f, d.h]);
    let up = stack(l, names[1], [e, f, d.h]);
    let down = stack(l, names[2], [e, d.h, f]);
    l.node(
        &format!("{prefix}.experts"),
        Op::Experts(ExpertsOp {
            act: d.act,
            split: m.split,
        }),
        &[x, &routing, &gate, &up, &down],
    )
}

fn lm_head(post: &mut Emit, d: &Dims, x: &str, tied_to: &str, name: &str) {
    let w = if d.tie {
        tied_to.to_string()
    } else {
        post.weight(
            &format!("{name}.weight"),
            &[d.vocab, d.h],
            &[(0, Groups::Plain { padded: true })],
        )
    };
    let logits = post.node(name, Op::Linear(LinearOp::default()), &[x, &w]);
    post.node(
        "logits",
        Op::Output(OutputOp {
            name: "logits".into(),
        }),
        &[&logits],
    );
}

fn gpt2(c: &FamilyConfig, d: &Dims, pre: &mut Emit) -> Result<Lowered> {
    let positions = c.max_position_embeddings.unwrap_or(1024);
    let wte = pre.embedding("transformer.wte", "input_ids", d.vocab, d.h);
    let wpe = pre.embedding("transformer.wpe", "positions", positions, d.h);
    let embed = pre.node("transformer.embed", Op::Add(AddOp {}), &[&wte, &wpe]);
    let (hd, n) = (d.head_dim, d.heads);
    let mut l = Emit::default();
    let p = "transformer.h.{i}";
    let x = l.layer_norm(&format!("{p}.ln_1"), "hidden", d.h, d.eps);
    let fused = Groups::Concat(vec![
        heads(n, hd, Some(n)),
        heads(n, hd, Some(n)),
        heads(n, hd, Some(n)),
    ]);
    let qkv = l.linear(
        &format!("{p}.attn.c_attn"),
        &x,
        WeightOrder::InOut,
        (d.h, 3 * d.h),
        Some(fused.clone()),
        None,
        true,
    );
    let parts: Vec<String> = ["q", "k", "v"]
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let op = Op::Unfuse(UnfuseOp {
                groups: fused.clone(),
                part: i as u32,
            });
            l.node(&format!("{p}.attn.{s}"), op, &[&qkv])
        })
        .collect();
    let attn_op = Op::Attention(AttentionOp {
        head_dim: hd,
        scale: None,
    });
    let a = l.node(
        &format!("{p}.attn.attn"),
        attn_op,
        &[&parts[0], &parts[1], &parts[2]],
    );
    let o = l.linear(
        &format!("{p}.attn.c_proj"),
        &a,
        WeightOrder::InOut,
        (d.h, d.h),
        None,
        Some(heads(n, hd, Some(n))),
        true,
    );
    let h1 = l.node(
        &format!("{p}.attn_residual"),
        Op::Add(AddOp {}),
        &["hidden", &o],
    );
    let x2 = l.layer_norm(&format!("{p}.ln_2"), &h1, d.h, d.eps);
    let fc = l.linear(
        &format!("{p}.mlp.c_fc"),
        &x2,
        WeightOrder::InOut,
        (d.h, d.ffn),
        None,
        None,
        true,
    );
    let act = l.node(
        &format!("{p}.mlp.act"),
        Op::Activation(ActivationOp { kind: d.act }),
        &[&fc],
    );
    let proj = l.linear(
        &format!("{p}.mlp.c_proj"),
        &act,
        WeightOrder::InOut,
        (d.ffn, d.h),
        None,
        None,
        true,
    );
    let result = l.node(
        &format!("{p}.mlp_residual"),
        Op::Add(AddOp {}),
        &[&h1, &proj],
    );

    let mut post = Emit::default();
    let f = post.layer_norm("transformer.ln_f", "hidden", d.h, d.eps);
    lm_head(&mut post, d, &f, "transformer.wte.weight", "lm_head");
    Ok((l.into(), embed, result, post))
}

fn gpt_neox(c: &FamilyConfig, d: &Dims, pre: &mut Emit) -> Result<Lowered> {
    let embed = pre.embedding("gpt_neox.embed_in", "input_ids", d.vocab, d.h);
    let rope = rope_op(c, d)?;
    let (hd, n) = (d.head_dim, d.heads);
    if d.kv_heads != n {
        return Err(TpcError::Model {
            model: model_name(c),
            place: "preset".into(),
            message: "GPT-NeoX has no grouped kv heads; remove num_key_value_heads".into(),
        });
    }
    let mut l = Emit::default();
    let p = "gpt_neox.layers.{i}";
    let x = l.layer_norm(&format!("{p}.input_layernorm"), "hidden", d.h, d.eps);
    let fused = Groups::Interleaved {
        heads: n,
        parts: vec![hd, hd, hd],
    };
    let qkv = l.linear(
        &format!("{p}.attention.query_key_value"),
        &x,
        WeightOrder::OutIn,
        (d.h, 3 * d.h),
        Some(fused.clone()),
        None,
        d.bias,
    );
    let mut parts = Vec::new();
    for (i, s) in ["q", "k", "v"].iter().enumerate() {
        let op = Op::Unfuse(UnfuseOp {
            groups: fused.clone(),
            part: i as u32,
        });
        let mut y = l.node(&format!("{p}.attention.{s}"), op, &[&qkv]);
        if *s != "v" {
            y = l.node(
                &format!("{p}.attention.{s}_rope"),
                rope.clone(),
                &[&y, "positions"],
            );
        }
        parts.push(y);
    }
    let attn_op = Op::Attention(AttentionOp {
        head_dim: hd,
        scale: None,
    });
    let a = l.node(
        &format!("{p}.attention.attn"),
        attn_op,
        &[&parts[0], &parts[1], &parts[2]],
    );
    let o = l.linear(
        &format!("{p}.attention.dense"),
        &a,
        WeightOrder::OutIn,
        (d.h, d.h),
        None,
        Some(heads(n, hd, Some(n))),
        d.bias,
    );
    let parallel = c.use_parallel_residual.unwrap_or(true);
    let mlp_in = if parallel {
        "hidden".to_string()
    } else {
        l.node(
            &format!("{p}.attn_residual"),
            Op::Add(AddOp {}),
            &["hidden", &o],
        )
    };
    let x2 = l.layer_norm(
        &format!("{p}.post_attention_layernorm"),
        &mlp_in,
        d.h,
        d.eps,
    );
    let up = l.linear(
        &format!("{p}.mlp.dense_h_to_4h"),
        &x2,
        WeightOrder::OutIn,
        (d.h, d.ffn),
        None,
        None,
        d.bias,
    );
    let act = l.node(
        &format!("{p}.mlp.act"),
        Op::Activation(ActivationOp { kind: d.act }),
        &[&up],
    );
    let down = l.linear(
        &format!("{p}.mlp.dense_4h_to_h"),
        &act,
        WeightOrder::OutIn,
        (d.ffn, d.h),
        None,
        None,
        d.bias,
    );
    let result = if parallel {
        // HF: mlp_output + attn_output + hidden_states; the two partial sums meet first.
        let both = l.node(&format!("{p}.attn_mlp"), Op::Add(AddOp {}), &[&down, &o]);
        l.node(
            &format!("{p}.residual"),
            Op::Add(AddOp {}),
            &[&both, "hidden"],
        )
    } else {
        l.node(
            &format!("{p}.residual"),
            Op::Add(AddOp {}),
            &[&mlp_in, &down],
        )
    };

    let mut post = Emit::default();
    let f = post.layer_norm("gpt_neox.final_layer_norm", "hidden", d.h, d.eps);
    lm_head(&mut post, d, &f, "gpt_neox.embed_in.weight", "embed_out");
    Ok((l.into(), embed, result, post))
}

//! The runtime's tests, one module per subject: parity with HF, batches, pipeline stages,
//! sharding options, failure handling. One test binary, so one link step (see `[[test]]`
//! in Cargo.toml).

#[path = "../common/mod.rs"]
mod common;
#[path = "../contract/mod.rs"]
mod contract;
#[path = "../common/scratch.rs"]
mod scratch;

mod backend_contract;
mod batch;
mod engine_serve;
mod invariant;
mod moe_edges;
mod moe_ep;
mod moe_ep_serve;
mod moe_parity;
mod paged;
mod parity;
mod pipeline;
mod plan_provenance;
mod quant_fp8;
mod quant_int4;
mod quant_int8;
mod quant_packed;
// The fuzzers' seeded generator, for the structural plan fuzzer; not every helper is used.
#[allow(dead_code)]
#[path = "../fuzz/rng.rs"]
mod rng;
mod runtime;
mod serve_http;
mod shard_options;
mod tp_shares;

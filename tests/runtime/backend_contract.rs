//! The backend contract (`tests/contract`) on the CPU backend: two compute threads, the
//! linear kernels this host detects, f32 or bf16 linear weights.

use tpc::runtime::cpu::CpuBackend;

fn cpu(bf16: bool) -> Option<CpuBackend> {
    Some(CpuBackend::new(2).with_bf16_linears(bf16))
}

crate::contract::backend_contract!(cpu);

//! The backend contract (`tests/contract`) on the CUDA backend: on GPU 0 where there is one
//! (a skip line otherwise, a failure with `TPC_REQUIRE_GPU` set), and on the emulated GPU of
//! `tests/emulator` in a child process, as `device.rs` runs its GPU tests.
#![cfg(feature = "cuda")]

use super::device::{emulated_gpu_path, emulation_wanted, gpu_present};
use std::process::Command;

/// The contract's tests on GPU 0.
mod on_gpu {
    use std::sync::Arc;
    use tpc::runtime::cuda::backend::CudaBackend;
    use tpc::runtime::cuda::device::GpuRank;

    fn cuda(bf16: bool) -> Option<CudaBackend> {
        if !super::gpu_present("the backend contract on a GPU") {
            return None;
        }
        let gpu = GpuRank::open(0, 0).unwrap_or_else(|e| panic!("opening GPU 0: {e}"));
        Some(CudaBackend::new(Arc::new(gpu), bf16))
    }

    crate::contract::backend_contract!(cuda);
}

/// The harness's name for the tests of `on_gpu` (`backend_contract::on_gpu::`), a filter.
fn on_gpu_filter() -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    format!("{module}::on_gpu::")
}

/// This test binary with `args`, on the emulated GPU; its stdout and stderr.
fn on_the_emulated_gpu(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(args)
        .env("LD_LIBRARY_PATH", emulated_gpu_path())
        .env("TPC_REQUIRE_GPU", "1")
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// Every clause of the contract on the emulated GPU: the child runs `on_gpu`'s tests with a
/// GPU required, so none may skip, and all of them must run and pass.
#[test]
fn the_backend_contract_holds_on_the_emulated_gpu() {
    if !emulation_wanted("the_backend_contract_holds_on_the_emulated_gpu") {
        return;
    }
    let filter = on_gpu_filter();
    let (_, listed, _) = on_the_emulated_gpu(&[&filter, "--list"]);
    let tests = listed.lines().filter(|l| l.ends_with(": test")).count();
    assert!(tests > 0, "no tests match {filter}:\n{listed}");
    let (ok, stdout, stderr) = on_the_emulated_gpu(&[&filter]);
    assert!(
        ok && stdout.contains(&format!("test result: ok. {tests} passed")),
        "the backend contract on the emulated GPU ({tests} tests):\n{stdout}\n{stderr}"
    );
    eprintln!("the backend contract: {tests} tests passed on the emulated GPU");
}

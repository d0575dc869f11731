//! Every kernel in `kernels/` compiles with NVRTC for sm_80 and sm_90 (PTX for compute_80
//! and compute_90) with no error and no warning, and the PTX defines every kernel the file
//! declares. No GPU, driver or CUDA header is needed, only libnvrtc on the loader path.
//! Where libnvrtc is missing the test prints a skip line, unless
//! `TPC_REQUIRE_NVRTC` is set (`.ci/run` installs NVRTC and sets it).
#![cfg(feature = "cuda")]

use tpc::runtime::cuda::nvrtc::{compile, Target};
use tpc::runtime::cuda::probe::{require, Library};
use tpc::runtime::cuda::sources::{expanded, kernel_names, KERNEL_FILES};
use tpc::runtime::cuda::CudaError;

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_warnings() {
    if let Err(e) = require(Library::Nvrtc) {
        assert!(
            std::env::var_os("TPC_REQUIRE_NVRTC").is_none(),
            "TPC_REQUIRE_NVRTC is set but NVRTC cannot be loaded: {e}"
        );
        eprintln!("SKIP every_kernel_compiles_for_sm80_and_sm90_without_warnings: {e}");
        return;
    }
    let mut failures = Vec::new();
    let mut compiled = 0;
    for cc in [80, 90] {
        let target = Target {
            compute_capability: cc,
        };
        for (file, text) in KERNEL_FILES {
            match compile(file, &target) {
                Err(e) => failures.push(e.to_string()),
                Ok(ptx) => {
                    let ptx = ptx.to_src();
                    assert!(
                        ptx.contains(&format!(".target sm_{cc}")),
                        "{file}: PTX not for sm_{cc}"
                    );
                    for name in kernel_names(text) {
                        if !ptx.contains(&format!(".entry {name}(")) {
                            failures
                                .push(format!("{file} for sm_{cc}: no kernel `{name}` in the PTX"));
                        }
                    }
                    compiled += 1;
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert_eq!(compiled, 2 * KERNEL_FILES.len());
    eprintln!("compiled {compiled} kernel files (sm_80, sm_90)");
}

#[test]
fn every_kernel_file_in_the_folder_is_built_in() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    on_disk.sort();
    let built_in: Vec<&str> = KERNEL_FILES.iter().map(|(n, _)| *n).collect();
    assert_eq!(on_disk, built_in);
}

#[test]
fn the_header_is_pasted_once_with_line_directives() {
    let text = expanded("norm.cu").unwrap();
    assert_eq!(
        text.matches("__device__ __forceinline__ float block_sum")
            .count(),
        1
    );
    assert!(!text.lines().any(|l| l.trim() == "#include \"common.cuh\""));
    assert!(text.contains("#line 1 \"common.cuh\""));
    // norm.cu includes the header on line 2: its line 3 follows the directive.
    let after = text.split("#line 3 \"norm.cu\"\n").nth(1).unwrap();
    let norm = KERNEL_FILES
        .iter()
        .find(|(n, _)| *n == "norm.cu")
        .unwrap()
        .1;
    assert_eq!(after.lines().next(), norm.lines().nth(2));
    assert!(matches!(
        expanded("nope.cu"),
        Err(CudaError::UnknownKernelFile(_))
    ));
}

#[test]
fn kernel_names_are_read_from_the_source() {
    let norm = KERNEL_FILES
        .iter()
        .find(|(n, _)| *n == "norm.cu")
        .unwrap()
        .1;
    assert_eq!(
        kernel_names(norm),
        ["rms_norm", "add_rms_norm", "layer_norm"]
    );
    let all: usize = KERNEL_FILES
        .iter()
        .map(|(_, t)| kernel_names(t).len())
        .sum();
    assert!(all >= 20, "{all} kernels");
}

/// Bytes of static shared memory a PTX module declares (`.shared` variables at module scope,
/// where NVRTC puts every kernel's `__shared__` arrays).
fn static_shared_bytes(ptx: &str) -> Result<usize, String> {
    let mut total = 0;
    for line in ptx.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix(".shared") else {
            continue;
        };
        let words: Vec<&str> = rest.trim_end_matches(';').split_whitespace().collect();
        let ty = words
            .iter()
            .find(|w| {
                w.starts_with(".b")
                    || w.starts_with(".f")
                    || w.starts_with(".u")
                    || w.starts_with(".s")
            })
            .ok_or_else(|| format!("no type in `{line}`"))?;
        let bits: usize = ty[2..]
            .parse()
            .map_err(|_| format!("type {ty} in `{line}`"))?;
        let name = words.last().ok_or_else(|| format!("no name in `{line}`"))?;
        let count = match name.split_once('[') {
            Some((_, n)) => n
                .trim_end_matches(']')
                .parse::<usize>()
                .map_err(|_| format!("array size in `{line}`"))?,
            None => 1,
        };
        total += count * bits / 8;
    }
    Ok(total)
}

#[test]
fn every_kernel_file_fits_the_static_shared_memory_limit() {
    // 48 KiB is what a block may declare statically on every GPU from sm_80 on (more needs
    // dynamic shared memory and an opt-in); the whole file's total bounds each kernel's.
    const LIMIT: usize = 48 * 1024;
    if let Err(e) = require(Library::Nvrtc) {
        assert!(
            std::env::var_os("TPC_REQUIRE_NVRTC").is_none(),
            "TPC_REQUIRE_NVRTC is set but NVRTC cannot be loaded: {e}"
        );
        eprintln!("SKIP every_kernel_file_fits_the_static_shared_memory_limit: {e}");
        return;
    }
    let target = Target {
        compute_capability: 80,
    };
    let mut sizes = Vec::new();
    for (file, _) in KERNEL_FILES {
        let ptx = compile(file, &target).unwrap().to_src();
        let bytes = static_shared_bytes(&ptx).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(
            bytes <= LIMIT,
            "{file}: {bytes} bytes of static shared memory"
        );
        sizes.push((*file, bytes));
    }
    eprintln!("static shared bytes: {sizes:?}");
    // attention_tiled's two tiles of 16 keys x 256 dims alone are 32 KiB: the parse sees them.
    let attention = sizes.iter().find(|(f, _)| *f == "attention.cu").unwrap().1;
    assert!(attention >= 32 * 1024, "attention.cu: {attention} bytes");
}

#[test]
fn shared_declarations_are_read_from_ptx() {
    let ptx = "\t.shared .align 4 .b8 _ZZ15attention_tiledE6tile_k[16384];\n\
               .shared .align 8 .u64 flag;\n.visible .entry k(\n";
    assert_eq!(static_shared_bytes(ptx), Ok(16384 + 8));
}

//! The kernel sources, built into the binary: every `kernels/*.cu`, each with the shared
//! header `kernels/common.cuh` pasted where it includes it (NVRTC compiles one text per
//! program and the binary must not need the repository at run time).

use super::CudaError;

const COMMON: &str = include_str!("../../../kernels/common.cuh");
const INCLUDE_COMMON: &str = "#include \"common.cuh\"";

/// Every kernel file, by name under `kernels/`.
pub const KERNEL_FILES: &[(&str, &str)] = &[
    (
        "allreduce.cu",
        include_str!("../../../kernels/allreduce.cu"),
    ),
    ("argmax.cu", include_str!("../../../kernels/argmax.cu")),
    (
        "attention.cu",
        include_str!("../../../kernels/attention.cu"),
    ),
    (
        "elementwise.cu",
        include_str!("../../../kernels/elementwise.cu"),
    ),
    (
        "embedding.cu",
        include_str!("../../../kernels/embedding.cu"),
    ),
    (
        "invariant.cu",
        include_str!("../../../kernels/invariant.cu"),
    ),
    ("moe.cu", include_str!("../../../kernels/moe.cu")),
    ("norm.cu", include_str!("../../../kernels/norm.cu")),
    ("quant.cu", include_str!("../../../kernels/quant.cu")),
    ("rope.cu", include_str!("../../../kernels/rope.cu")),
    ("select.cu", include_str!("../../../kernels/select.cu")),
];

/// The text NVRTC compiles for `file`: the header pasted in, `#line` directives keeping
/// NVRTC's messages pointing at the right file and line.
pub fn expanded(file: &str) -> Result<String, CudaError> {
    let (_, text) = KERNEL_FILES
        .iter()
        .find(|(name, _)| *name == file)
        .ok_or_else(|| CudaError::UnknownKernelFile(file.to_string()))?;
    let mut out = String::with_capacity(COMMON.len() + text.len() + 64);
    for (n, line) in text.lines().enumerate() {
        if line.trim() == INCLUDE_COMMON {
            out.push_str("#line 1 \"common.cuh\"\n");
            out.push_str(COMMON);
            if !COMMON.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(&format!("#line {} \"{file}\"\n", n + 2));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    Ok(out)
}

/// The `extern "C" __global__` functions a kernel file defines, in order (what a module
/// loaded from it must provide).
pub fn kernel_names(text: &str) -> Vec<&str> {
    text.split("extern \"C\" __global__ void")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(str::trim)
        .collect()
}

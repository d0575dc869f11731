//! Compiling the kernel files with NVRTC: no GPU, driver or CUDA headers needed, only
//! `libnvrtc` (the kernels include no CUDA header).
//! A kernel that compiles with a warning is refused like one that does not compile: the
//! kernels are few, and a warning there is usually a bug (a narrowing, an unused result).

use super::probe::{require, Library};
use super::sources::expanded;
use super::CudaError;
use cudarc::nvrtc::{result, Ptx};
use std::ffi::{c_char, CStr, CString};

/// How to compile: for which virtual architecture (`compute_90` for an H100/H200).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Compute capability as major·10 + minor (80 for A100, 90 for H100/H200).
    pub compute_capability: u32,
}

impl Target {
    pub fn arch(&self) -> String {
        format!("compute_{}", self.compute_capability)
    }

    fn options(&self) -> Vec<String> {
        vec![
            format!("--gpu-architecture={}", self.arch()),
            "--std=c++17".to_string(),
            // Activations are f32 and the tolerances assume IEEE division and square root.
            "--prec-div=true".to_string(),
            "--prec-sqrt=true".to_string(),
            "--fmad=true".to_string(),
        ]
    }
}

/// The PTX of kernel file `file` (a name under `kernels/`) for `target`.
pub fn compile(file: &str, target: &Target) -> Result<Ptx, CudaError> {
    require(Library::Nvrtc)?;
    let fail = |problem: String, log: String| CudaError::Compile {
        file: file.to_string(),
        arch: target.arch(),
        problem,
        log,
    };
    let source = CString::new(expanded(file)?)
        .map_err(|_| fail("the source holds a NUL byte".into(), String::new()))?;
    let name =
        CString::new(file).map_err(|_| fail("a NUL byte in its name".into(), String::new()))?;
    let program = Program(
        result::create_program(&source, Some(&name))
            .map_err(|e| fail(format!("nvrtcCreateProgram: {e:?}"), String::new()))?,
    );
    // SAFETY: `program` is a live program (dropped, and so destroyed, only at the end of
    // this function), and `source` and `name`, which it may point into, outlive it.
    let compiled = unsafe { result::compile_program(program.0, &target.options()) };
    let log = unsafe { result::get_program_log(program.0) }
        .map(|raw| text_of(&raw))
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(fail(format!("did not compile ({e:?})"), log));
    }
    if !log.trim().is_empty() {
        return Err(fail("compiled with warnings".into(), log));
    }
    let ptx = unsafe { result::get_ptx(program.0) }
        .map_err(|e| fail(format!("nvrtcGetPTX: {e:?}"), String::new()))?;
    Ok(Ptx::from_src(text_of(&ptx)))
}

/// A C string NVRTC filled in (NUL-terminated, or not at all when empty) as Rust text.
fn text_of(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// An NVRTC program, destroyed when dropped.
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed only here. A failure to
        // destroy leaks the program; there is nothing better to do in a destructor.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// The PTX of every kernel file for `target`, compiled once per process and architecture
/// (ranks and repeated runs reuse it).
pub fn compiled_all(target: &Target) -> Result<Vec<(&'static str, String)>, CudaError> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    type Cache = Mutex<HashMap<u32, Vec<(&'static str, String)>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    // A panic while compiling leaves no entry behind: the map is usable after a poison.
    let mut map = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(done) = map.get(&target.compute_capability) {
        return Ok(done.clone());
    }
    let mut all = Vec::with_capacity(super::sources::KERNEL_FILES.len());
    for (file, _) in super::sources::KERNEL_FILES {
        all.push((*file, compile(file, target)?.to_src()));
    }
    map.insert(target.compute_capability, all.clone());
    Ok(all)
}

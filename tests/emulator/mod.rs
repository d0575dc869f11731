//! The kernels of `kernels/` run on the CPU: g++ compiles a kernel file with
//! `cuda_on_cpu.hpp` (CUDA's thread model as fibers) into a shared library, loaded here, and
//! a launch takes its arguments as `cuLaunchKernel` does. Every launch runs twice, threads
//! scheduled in increasing then decreasing order, from the same inputs: the two results must
//! be bit-equal (else the kernel races on shared memory), and no kernel may write outside
//! its buffers (each has guard words on both sides, checked after every launch).

use libloading::{Library, Symbol};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

pub const fn dims(x: u32, y: u32) -> Dims {
    Dims { x, y, z: 1 }
}

type LaunchFn = unsafe extern "C" fn(Dims, Dims, *mut *mut c_void, c_int) -> c_int;
type ErrorFn = unsafe extern "C" fn() -> *const c_char;

/// One kernel file, compiled for the CPU.
pub struct KernelFile {
    lib: Library,
    file: String,
}

/// Guard words on each side of a buffer.
const GUARD: usize = 16;
const GUARD_WORD: u32 = 0x7fa5_a5a5; // a NaN: a kernel that reads it spreads it

/// Buffers a launch reads and writes, each as 32-bit words between guards.
#[derive(Default, Clone)]
pub struct Buffers {
    bufs: Vec<Vec<u32>>,
}

#[derive(Clone, Copy, Debug)]
pub struct BufId(usize);

impl Buffers {
    fn push(&mut self, words: Vec<u32>) -> BufId {
        let mut all = vec![GUARD_WORD; GUARD];
        all.extend(words);
        all.extend(std::iter::repeat_n(GUARD_WORD, GUARD));
        self.bufs.push(all);
        BufId(self.bufs.len() - 1)
    }
    pub fn f32(&mut self, values: &[f32]) -> BufId {
        self.push(values.iter().map(|v| v.to_bits()).collect())
    }
    pub fn i64(&mut self, values: &[i64]) -> BufId {
        self.push(values.iter().flat_map(|&v| split64(v as u64)).collect())
    }
    pub fn u64(&mut self, values: &[u64]) -> BufId {
        self.push(values.iter().flat_map(|&v| split64(v)).collect())
    }
    /// Bytes, four to a word (little-endian, the last word padded with zeros).
    pub fn bytes(&mut self, bytes: &[u8]) -> BufId {
        let words = bytes
            .chunks(4)
            .map(|c| c.iter().rev().fold(0u32, |w, &b| w << 8 | b as u32))
            .collect();
        self.push(words)
    }
    pub fn u32(&mut self, values: &[u32]) -> BufId {
        self.push(values.to_vec())
    }
    /// bf16 values as their bits, two to a word (an odd count padded with a zero).
    pub fn bf16(&mut self, bits: &[u16]) -> BufId {
        let words = bits
            .chunks(2)
            .map(|c| c[0] as u32 | (c.get(1).copied().unwrap_or(0) as u32) << 16)
            .collect();
        self.push(words)
    }
    fn words(&self, id: BufId) -> &[u32] {
        let all = &self.bufs[id.0];
        &all[GUARD..all.len() - GUARD]
    }
    pub fn read_f32(&self, id: BufId) -> Vec<f32> {
        self.words(id).iter().map(|&w| f32::from_bits(w)).collect()
    }
    pub fn read_u16(&self, id: BufId) -> Vec<u16> {
        self.words(id)
            .iter()
            .flat_map(|&w| [w as u16, (w >> 16) as u16])
            .collect()
    }
    /// Bytes, four to a word as [`Buffers::bytes`] stores them (a padded last word's too).
    pub fn read_bytes(&self, id: BufId) -> Vec<u8> {
        self.words(id)
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }
    pub fn read_u64(&self, id: BufId) -> Vec<u64> {
        self.words(id)
            .chunks(2)
            .map(|c| c[0] as u64 | (c[1] as u64) << 32)
            .collect()
    }
    fn guards_intact(&self) -> Result<(), String> {
        for (i, all) in self.bufs.iter().enumerate() {
            let n = all.len() - 2 * GUARD;
            let below = all[..GUARD].iter().any(|&w| w != GUARD_WORD);
            let above = all[GUARD + n..].iter().any(|&w| w != GUARD_WORD);
            if below || above {
                return Err(format!(
                    "buffer {i} ({n} words): written {} its end",
                    if below { "before" } else { "past" }
                ));
            }
        }
        Ok(())
    }
}

fn split64(v: u64) -> [u32; 2] {
    [v as u32, (v >> 32) as u32]
}

/// One kernel argument, as the kernel's C signature takes it.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Buf(BufId),
    I64(i64),
    I32(i32),
    F32(f32),
    Null,
}

/// Storage for one argument's value while a launch reads it.
#[repr(C)]
union Slot {
    ptr: *mut c_void,
    i64: i64,
    i32: i32,
    f32: f32,
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The `extern "C" __global__` kernels a file defines.
fn kernel_names(text: &str) -> Vec<String> {
    text.split("extern \"C\" __global__ void")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(|s| s.trim().to_string())
        .collect()
}

/// The C++ that includes kernel files (paths under `kernels/`) after the emulator header
/// and exports a launcher for each of their kernels; their names, in order.
fn kernels_source(files: &[&str]) -> Result<(String, Vec<String>), String> {
    let mut cpp = String::from("#include \"cuda_on_cpu.hpp\"\n");
    let mut names = Vec::new();
    for file in files {
        let source = repo().join("kernels").join(file);
        let text = std::fs::read_to_string(&source).map_err(|e| format!("{file}: {e}"))?;
        cpp.push_str(&format!("#include \"{}\"\n", source.display()));
        names.extend(kernel_names(&text));
    }
    for name in &names {
        cpp.push_str(&format!("EMU_EXPORT({name})\n"));
    }
    Ok((cpp, names))
}

/// Compiles `cpp` (written to `stem`.cpp in `dir`) into the shared library `lib`.
fn build(dir: &Path, stem: &str, cpp: &str, lib: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let source = dir.join(format!("{stem}.cpp"));
    std::fs::write(&source, cpp).map_err(|e| e.to_string())?;
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O2", "-shared", "-fPIC", "-Wall", "-Werror"])
        .args(["-Wno-unknown-pragmas", "-Wno-unused-function"])
        .arg("-I")
        .arg(repo().join("tests/emulator"))
        .arg("-I")
        .arg(repo().join("kernels"))
        .arg(&source)
        .arg("-o")
        .arg(lib)
        .output()
        .map_err(|e| format!("running {cxx} (a C++20 compiler is needed): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cxx} could not compile {} for the CPU:\n{}",
            source.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

fn scratch() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

fn compile(file: &str) -> Result<KernelFile, String> {
    let (cpp, _) = kernels_source(&[file])?;
    let stem = file.trim_end_matches(".cu");
    let dir = scratch().join("emulated-kernels");
    // A per-process name: test binaries built at different times never load a stale copy.
    let lib = dir.join(format!("lib{stem}-{}.so", std::process::id()));
    build(&dir, stem, &cpp, &lib)?;
    // SAFETY: a library built just now from our own sources; its initialisers only set up
    // the emulator's globals.
    let lib = unsafe { Library::new(&lib) }.map_err(|e| e.to_string())?;
    Ok(KernelFile {
        lib,
        file: file.to_string(),
    })
}

/// Builds a stand-in `libcuda.so` (every kernel of `kernels/` on the emulator behind the
/// driver calls tpc makes, two GPUs: `fake_driver.hpp`), `libcublas.so` (`fake_cublas.cpp`)
/// and `libnccl.so` (`fake_nccl.cpp`) into a fresh folder, and returns it: put first on `LD_LIBRARY_PATH` of a process, it is that
/// process's GPU.
pub fn fake_cuda_libraries() -> Result<PathBuf, String> {
    // Once per test process: its tests share the folder.
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT.get_or_init(build_fake_cuda_libraries).clone()
}

fn build_fake_cuda_libraries() -> Result<PathBuf, String> {
    let dir = scratch().join(format!("fake-cuda-{}", std::process::id()));
    let mut files: Vec<String> = std::fs::read_dir(repo().join("kernels"))
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    files.sort();
    let files: Vec<&str> = files.iter().map(String::as_str).collect();
    let (mut cpp, names) = kernels_source(&files)?;
    cpp.push_str("#include \"fake_driver.hpp\"\nextern const FakeKernel KERNELS[] = {\n");
    for name in &names {
        cpp.push_str(&format!("    {{\"{name}\", emu_bind_{name}}},\n"));
    }
    cpp.push_str("};\nextern const size_t KERNEL_COUNT = sizeof KERNELS / sizeof KERNELS[0];\n");
    build(&dir, "fake_driver", &cpp, &dir.join("libcuda.so"))?;
    for (stem, lib) in [("fake_cublas", "libcublas.so"), ("fake_nccl", "libnccl.so")] {
        let cpp = std::fs::read_to_string(repo().join(format!("tests/emulator/{stem}.cpp")))
            .map_err(|e| e.to_string())?;
        build(&dir, stem, &cpp, &dir.join(lib))?;
    }
    Ok(dir)
}

/// The kernel file compiled for the CPU, once per test process.
pub fn kernel_file(file: &str) -> &'static KernelFile {
    static FILES: OnceLock<Mutex<HashMap<String, &'static KernelFile>>> = OnceLock::new();
    let files = FILES.get_or_init(Default::default);
    let mut files = files.lock().unwrap_or_else(|e| e.into_inner());
    files
        .entry(file.to_string())
        .or_insert_with(|| Box::leak(Box::new(compile(file).unwrap_or_else(|e| panic!("{e}")))))
}

/// The emulator's globals are per library, but launches from the test threads share a
/// process: one launch at a time keeps the reports simple.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

impl KernelFile {
    fn launch_once(
        &self,
        kernel: &str,
        grid: Dims,
        block: Dims,
        args: &[Arg],
        bufs: &mut Buffers,
        reverse: bool,
    ) -> Result<(), String> {
        let mut slots: Vec<Slot> = args
            .iter()
            .map(|a| match *a {
                Arg::Buf(id) => Slot {
                    ptr: bufs.bufs[id.0][GUARD..].as_mut_ptr() as *mut c_void,
                },
                Arg::I64(v) => Slot { i64: v },
                Arg::I32(v) => Slot { i32: v },
                Arg::F32(v) => Slot { f32: v },
                Arg::Null => Slot {
                    ptr: std::ptr::null_mut(),
                },
            })
            .collect();
        let mut pointers: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut Slot as *mut c_void)
            .collect();
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the symbols are the ones EMU_EXPORT defines, with these C signatures; the
        // arguments' types follow the kernel's signature (the caller's duty, as with
        // cuLaunchKernel), and every buffer outlives the call.
        let rc = unsafe {
            let launch: Symbol<LaunchFn> = self
                .lib
                .get(format!("emu_launch_{kernel}\0").as_bytes())
                .map_err(|e| format!("{}: no kernel {kernel}: {e}", self.file))?;
            launch(grid, block, pointers.as_mut_ptr(), reverse as c_int)
        };
        if rc != 0 {
            // SAFETY: as above; the message is a NUL-terminated string the library owns.
            let why = unsafe {
                let error: Symbol<ErrorFn> = self
                    .lib
                    .get(b"emu_last_error\0")
                    .map_err(|e| e.to_string())?;
                CStr::from_ptr(error()).to_string_lossy().into_owned()
            };
            return Err(format!("{kernel}: {why}"));
        }
        bufs.guards_intact().map_err(|e| format!("{kernel}: {e}"))
    }

    /// Launches `kernel` twice from the same buffers (threads in increasing, then
    /// decreasing order) and leaves the first run's results in `bufs`; an error when the
    /// two differ in any bit, a launch fails, or a buffer's guard was written.
    pub fn launch(
        &self,
        kernel: &str,
        grid: Dims,
        block: Dims,
        args: &[Arg],
        bufs: &mut Buffers,
    ) -> Result<(), String> {
        let before = bufs.clone();
        self.launch_once(kernel, grid, block, args, bufs, false)?;
        let mut backwards = before;
        self.launch_once(kernel, grid, block, args, &mut backwards, true)?;
        for (i, (a, b)) in bufs.bufs.iter().zip(&backwards.bufs).enumerate() {
            if let Some(w) = a.iter().zip(b).position(|(x, y)| x != y) {
                return Err(format!(
                    "{kernel}: buffer {i} word {} differs between thread orders ({:#x} vs {:#x}): a race",
                    w.saturating_sub(GUARD),
                    a[w],
                    b[w]
                ));
            }
        }
        Ok(())
    }
}

/// Deterministic values in [-1, 1), and raw bit patterns.
pub struct Values(pub u64);

impl Values {
    pub fn bits(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn next(&mut self) -> f32 {
        ((self.bits() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
    pub fn take(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
    /// One of `n` choices.
    pub fn below(&mut self, n: usize) -> usize {
        (self.bits() >> 33) as usize % n
    }
}

/// |got - want| / max(1, |want|) at most `tol` everywhere (a non-finite `got` never is).
pub fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = (g as f64 - w).abs() / w.abs().max(1.0);
        assert!(
            e <= tol,
            "{what}: error {e:.3e} > {tol:.0e} at {i}: got {g} want {w}"
        );
    }
}

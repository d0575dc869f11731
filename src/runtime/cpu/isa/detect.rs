//! What this CPU and OS let a process run, asked once.
//!
//! AVX2, AVX-512F and AVX512-BF16 come from the standard library's detection. AMX does not
//! (`is_x86_feature_detected!("amx-bf16")` is unstable): CPUID leaf 7 says whether the tiles
//! exist, and Linux hands out the 8 KiB tile state only to a process that asks for it
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); without that grant the first tile
//! instruction faults.

use std::sync::OnceLock;

/// The instruction sets the kernels can use on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFeatures {
    /// AVX2, FMA and F16C.
    pub avx2_fma: bool,
    pub avx512f: bool,
    /// AVX512-BF16, with AVX512-VNNI and AVX512-VL.
    pub avx512bf16: bool,
    /// AMX-TILE and AMX-BF16 on the CPU, and the tile state granted by the kernel.
    pub amx_bf16: bool,
    /// Why AMX is missing when the CPU has it (the OS refused the tile state).
    pub amx_refused: Option<String>,
}

/// This host's features (asked once per process; AMX permission is requested then).
pub fn host() -> &'static HostFeatures {
    static HOST: OnceLock<HostFeatures> = OnceLock::new();
    HOST.get_or_init(probe)
}

#[cfg(target_arch = "x86_64")]
fn probe() -> HostFeatures {
    // F16C too: the AVX2 code GEMV widens FP8 through fp16. Every AVX2 CPU has it.
    let avx2_fma = std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c");
    let avx512f = avx2_fma
        && std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw");
    // VNNI and VL too: the INT4 decode GEMV of that variant multiplies bytes
    // (`vpdpbusd`). Every CPU with AVX512-BF16 has them.
    let avx512bf16 = avx512f
        && std::is_x86_feature_detected!("avx512bf16")
        && std::is_x86_feature_detected!("avx512vnni")
        && std::is_x86_feature_detected!("avx512vl");
    let (amx_bf16, amx_refused) = if avx512bf16 && cpu_has_amx_bf16() {
        match request_tile_state() {
            Ok(()) => (true, None),
            Err(why) => (false, Some(why)),
        }
    } else {
        (false, None)
    };
    HostFeatures {
        avx2_fma,
        avx512f,
        avx512bf16,
        amx_bf16,
        amx_refused,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn probe() -> HostFeatures {
    HostFeatures {
        avx2_fma: false,
        avx512f: false,
        avx512bf16: false,
        amx_bf16: false,
        amx_refused: None,
    }
}

/// CPUID.(EAX=7, ECX=0):EDX bit 22 (AMX-BF16) and bit 24 (AMX-TILE).
#[cfg(target_arch = "x86_64")]
fn cpu_has_amx_bf16() -> bool {
    // CPUID exists on every x86-64 CPU; leaf 7 is valid when the maximum leaf (leaf 0's
    // EAX) reaches it.
    use std::arch::x86_64::__cpuid_count;
    if __cpuid_count(0, 0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 22) != 0 && edx & (1 << 24) != 0
}

/// Asks Linux for permission to use the AMX tile data state in this process.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_state() -> Result<(), String> {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes the process's permitted xstate
    // components; it reads and writes no user memory.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!(
            "the kernel refused the AMX tile state (arch_prctl: {})",
            std::io::Error::last_os_error()
        ))
    }
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_tile_state() -> Result<(), String> {
    Err("AMX tile state is only requested on Linux".into())
}

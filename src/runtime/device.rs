//! Where a run's ranks compute, as a type: [`Device::Cpu`] carries the CPU backend's own
//! settings ([`CpuOptions`]), so the generic run options hold none of them.

pub use super::cpu::CpuOptions;

/// Where a run's ranks compute (`--device cpu|cuda|cuda:0,1,…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Device {
    /// This host's cores, with the CPU backend's settings.
    Cpu(CpuOptions),
    /// GPUs by ordinal, ranks dealt to them round robin; empty: every GPU the driver sees.
    Cuda(Vec<usize>),
}

impl std::fmt::Display for Device {
    /// The `--device` spelling: `cpu`, `cuda`, `cuda:0,1`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu(_) => write!(f, "cpu"),
            Device::Cuda(list) if list.is_empty() => write!(f, "cuda"),
            Device::Cuda(list) => {
                let list: Vec<String> = list.iter().map(usize::to_string).collect();
                write!(f, "cuda:{}", list.join(","))
            }
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Device, String> {
        let bad = || format!("`{s}`: expected cpu, cuda, or cuda:N[,N…] (GPU ordinals)");
        match s {
            "cpu" => Ok(Device::cpu()),
            "cuda" => Ok(Device::Cuda(Vec::new())),
            _ => {
                let list = s.strip_prefix("cuda:").ok_or_else(bad)?;
                let ordinals = list
                    .split(',')
                    .map(|n| n.trim().parse::<usize>().ok().filter(|&n| n < 1024))
                    .collect::<Option<Vec<usize>>>()
                    .ok_or_else(bad)?;
                Ok(Device::Cuda(ordinals))
            }
        }
    }
}

impl Default for Device {
    fn default() -> Device {
        Device::cpu()
    }
}

impl Device {
    /// The CPU with the default settings (best kernels, cores shared out, no pinning).
    pub fn cpu() -> Device {
        Device::Cpu(CpuOptions::default())
    }

    /// The CPU backend's settings, when the ranks run on the CPU.
    pub fn cpu_options(&self) -> Option<&CpuOptions> {
        match self {
            Device::Cpu(o) => Some(o),
            Device::Cuda(_) => None,
        }
    }
}

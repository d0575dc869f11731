//! The hardware profiles shipped in `models/hw/`, built into the binary so that `--hw NAME`
//! finds them wherever tpc runs from or is installed (as `calibrate` carries its tiny
//! model), and the lookup of `--hw`'s argument: a profile file, else a shipped name.

use super::profile::HwProfile;
use crate::error::{Result, TpcError};
use std::path::{Path, PathBuf};

/// Name (the file's stem) and text of every file in `models/hw/`; a test keeps this list
/// equal to the folder.
const SHIPPED: [(&str, &str); 3] = [
    (
        "a100-pcie-8",
        include_str!("../../models/hw/a100-pcie-8.ron"),
    ),
    (
        "h100-ib400-2x8",
        include_str!("../../models/hw/h100-ib400-2x8.ron"),
    ),
    (
        "h100-sxm-nvswitch-8",
        include_str!("../../models/hw/h100-sxm-nvswitch-8.ron"),
    ),
];

/// The names `--hw` accepts besides paths, sorted.
pub fn shipped_names() -> Vec<&'static str> {
    SHIPPED.iter().map(|(name, _)| *name).collect()
}

/// The shipped profile `name` (`models/hw/NAME.ron`), checked as a file would be.
pub fn shipped(name: &str) -> Option<Result<HwProfile>> {
    let (_, text) = SHIPPED.iter().find(|(n, _)| *n == name)?;
    let path = PathBuf::from(format!("models/hw/{name}.ron"));
    Some(HwProfile::parse(&path, text))
}

/// `--hw`'s argument: the profile file at `arg` when there is one, else the shipped profile
/// of that name (`.ron` may be given), else an error that lists the shipped names.
pub fn find_profile(arg: &Path) -> Result<HwProfile> {
    // Anything there but a folder is read as a file (a FIFO or device is refused there).
    if arg.exists() && !arg.is_dir() {
        return HwProfile::load(arg);
    }
    let name = arg.to_str().map(|s| s.strip_suffix(".ron").unwrap_or(s));
    match name.and_then(shipped) {
        Some(profile) => profile,
        None => Err(TpcError::UnknownHwProfile {
            given: arg.to_path_buf(),
            names: shipped_names().into_iter().map(String::from).collect(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_is_the_folder_and_each_entry_is_its_file() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/hw");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "ron"))
            .map(|p| p.file_stem().unwrap().to_str().unwrap().to_string())
            .collect();
        on_disk.sort();
        assert_eq!(shipped_names(), on_disk, "SHIPPED must list models/hw/");
        for name in shipped_names() {
            let file = HwProfile::load(&dir.join(format!("{name}.ron"))).unwrap();
            assert_eq!(shipped(name).unwrap().unwrap(), file, "{name}");
        }
    }

    #[test]
    fn names_and_paths_resolve_and_an_unknown_one_lists_the_names() {
        let by_name = find_profile(Path::new("h100-sxm-nvswitch-8")).unwrap();
        assert_eq!(
            find_profile(Path::new("h100-sxm-nvswitch-8.ron")).unwrap(),
            by_name
        );
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/hw/h100-sxm-nvswitch-8.ron");
        assert_eq!(find_profile(&path).unwrap(), by_name);
        for unknown in ["h100", "no/such/dir/a100-pcie-8.ron", ""] {
            let e = find_profile(Path::new(unknown)).unwrap_err().to_string();
            assert!(
                e.contains("a100-pcie-8, h100-ib400-2x8, h100-sxm-nvswitch-8"),
                "{e}"
            );
            assert!(e.contains(&format!("`{unknown}`")), "{e}");
        }
    }
}

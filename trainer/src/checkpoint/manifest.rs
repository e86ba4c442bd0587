//! The checksum manifest (`checksums.sha256`): written with every checkpoint, verified on resume.

use super::{io_err, CheckpointError, CHECKSUM_FILE};
use std::path::Path;

/// SHA-256 of a file, hex, read in 1 MiB blocks.
fn sha256_file(path: &Path) -> Result<String, CheckpointError> {
    std::fs::File::open(path)
        .and_then(xdistill_shared::hf::sha256_hex)
        .map_err(io_err(path))
}

/// Writes `dir/checksums.sha256`: one `HEX  NAME` line per file of `dir`, sorted by name.
pub(super) fn write_manifest(dir: &Path) -> Result<(), CheckpointError> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if entry.path().is_file() && name != CHECKSUM_FILE {
            names.push(name);
        }
    }
    names.sort();
    let mut text = String::new();
    for name in names {
        text += &format!("{}  {name}\n", sha256_file(&dir.join(&name))?);
    }
    let path = dir.join(CHECKSUM_FILE);
    std::fs::write(&path, text).map_err(io_err(&path))
}

/// Checks every file named in `dir/checksums.sha256`. Returns `false` (nothing verified) for a
/// checkpoint written before manifests existed; a missing file or a wrong hash is an error
/// naming the file.
pub fn verify(dir: &Path) -> Result<bool, CheckpointError> {
    let manifest = dir.join(CHECKSUM_FILE);
    let text = match std::fs::read_to_string(&manifest) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err(&manifest)(e)),
    };
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Some((want, name)) = line.split_once("  ") else {
            return Err(CheckpointError::Corrupt {
                path: manifest.clone(),
                message: format!("bad line {line:?}"),
            });
        };
        let path = dir.join(name);
        if name.contains('/') || name.contains('\\') || !path.is_file() {
            return Err(CheckpointError::Corrupt {
                path,
                message: "file named in the checksum manifest is missing".into(),
            });
        }
        let got = sha256_file(&path)?;
        if got != want {
            return Err(CheckpointError::Corrupt {
                path,
                message: format!("SHA-256 {got} does not match the manifest's {want}"),
            });
        }
    }
    Ok(true)
}

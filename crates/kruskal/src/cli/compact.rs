//! `--compact` of `kruskal cpd` and `kruskal mttkrp`: the tensor relabeled
//! to the indices that occur (`kruskal_formats::compact`), and what the
//! output says about it.

use anyhow::Result;
use kruskal_formats::Compaction;
use serde_json::json;

use kruskal::console::thousands;
use kruskal::input::Loaded;

/// Replaces the loaded tensor by its relabeled twin and says, per mode,
/// what became of the dimension (unless `json`); `writes_factors`: the
/// factors will be written back in the file's numbering.
pub fn compact_tensor(loaded: &mut Loaded, json: bool, writes_factors: bool) -> Result<Compaction> {
    let (tensor, map) = kruskal_formats::compact(&loaded.tensor)?;
    loaded.tensor = tensor;
    if !json {
        let modes: Vec<String> = map
            .ids
            .iter()
            .zip(&map.dims)
            .enumerate()
            .map(|(m, (ids, &dim))| {
                format!(
                    "mode {}: {} -> {}",
                    m + 1,
                    thousands(u64::from(dim)),
                    thousands(ids.len() as u64)
                )
            })
            .collect();
        println!(
            "compact    relabeled to the indices that occur ({})",
            modes.join(", ")
        );
        if writes_factors {
            println!(
                "           the factors are written in the file's numbering, zero rows where an index does not occur"
            );
        }
    }
    Ok(map)
}

/// The `--json` report's `compact`: per mode, the dimension and the
/// indices that occur.
pub fn json(map: &Compaction) -> serde_json::Value {
    map.ids
        .iter()
        .zip(&map.dims)
        .enumerate()
        .map(|(m, (ids, &dim))| json!({"mode": m + 1, "dim": dim, "occurring": ids.len()}))
        .collect()
}

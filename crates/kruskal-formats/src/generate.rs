//! Synthetic tensors: power-law tensors shaped like the FROSTT collection, and
//! planted low-rank tensors whose true factors are known.
//!
//! Every generator is seeded and deterministic: the same spec gives the same
//! tensor on any machine and with any number of threads (nonzeros are drawn
//! in fixed-size blocks, each from its own stream derived from the seed).

use ndarray::Array2;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal, Zipf};
use rayon::prelude::*;

use crate::coalesce::{Key, KeyWidth, coordinate_of, key_of};
use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};
use crate::memory;

/// Nonzeros drawn from one random stream; fixed so that output does not
/// depend on the thread count.
const BLOCK_NNZ: usize = 1 << 16;

/// The Zipf exponent used when none is given (FROSTT tensors' hot modes are
/// close to it).
pub const DEFAULT_EXPONENT: f64 = 1.1;

/// A power-law tensor: in each mode, index `perm[r - 1]` where `r` follows a
/// bounded Zipf law `P(r) ~ r^-s` over `1..=dim` and `perm` is a seeded
/// random permutation of the mode's indices (so hot indices are scattered,
/// as in real data). Coordinates are distinct; values are uniform in
/// `[0, 1)`.
#[derive(Clone, Debug, PartialEq)]
pub struct PowerLawSpec {
    pub dims: Vec<u32>,
    pub nnz: usize,
    /// One Zipf exponent per mode (`s >= 0`; 0 gives uniform indices).
    pub exponents: Vec<f64>,
    pub seed: u64,
    /// `nnz` is the number of distinct coordinates (true, the default), or
    /// of draws, of which only the distinct ones are kept (fewer where the
    /// law draws a coordinate twice; no error when `nnz` exceeds the cells).
    pub exact: bool,
}

impl PowerLawSpec {
    /// A spec with exponent [`DEFAULT_EXPONENT`] in every mode and seed 1.
    pub fn new(dims: Vec<u32>, nnz: usize) -> Self {
        let exponents = vec![DEFAULT_EXPONENT; dims.len()];
        PowerLawSpec {
            dims,
            nnz,
            exponents,
            seed: 1,
            exact: true,
        }
    }

    /// The spec of a FROSTT-shaped preset with `nnz` nonzeros, or the real
    /// tensor's count when `nnz` is `None` (an error for the few whose
    /// count is not recorded, [`Preset::nnz`]).
    pub fn like(preset: &Preset, nnz: Option<usize>) -> Result<Self> {
        Ok(PowerLawSpec::new(preset.dims.to_vec(), preset.nnz_or(nnz)?))
    }

    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    pub fn with_nnz(mut self, nnz: usize) -> Self {
        self.nnz = nnz;
        self
    }

    /// `nnz` counts draws, not distinct coordinates (see
    /// [`PowerLawSpec::exact`]): the law's own concentration, at any
    /// density, for tests of hot rows.
    pub fn with_draws(mut self) -> Self {
        self.exact = false;
        self
    }
}

/// Stream seeds: one per (purpose, mode, block), mixed so that neighbouring
/// blocks get unrelated streams.
fn stream_seed(seed: u64, purpose: u64, mode: u64, block: u64) -> u64 {
    let mut x = seed ^ purpose.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= mode.wrapping_mul(0xBF58_476D_1CE4_E5B9).rotate_left(17);
    x ^= block.wrapping_mul(0x94D0_49BB_1331_11EB).rotate_left(41);
    // splitmix64 finalizer
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn check_dims(dims: &[u32]) -> Result<()> {
    if dims.len() < 2 {
        return Err(FormatError::Argument(format!(
            "a generated tensor needs at least 2 modes, got {}",
            dims.len()
        )));
    }
    if dims.len() > crate::coo::MAX_MODES {
        return Err(FormatError::Argument(format!(
            "{} modes: kruskal takes at most {}",
            dims.len(),
            crate::coo::MAX_MODES
        )));
    }
    if let Some(m) = dims.iter().position(|&d| d == 0) {
        return Err(FormatError::Argument(format!("dimension of mode {m} is 0")));
    }
    Ok(())
}

/// Most rounds of extra draws [`power_law`] makes to replace coordinates
/// drawn more than once before it gives up.
const MAX_TOP_UP_ROUNDS: usize = 32;

/// Generates a power-law tensor with exactly `spec.nnz` distinct
/// coordinates. Coordinates are drawn until that many distinct ones are
/// found (a hot power law draws many twice: a quarter of the draws for a
/// nell-2 shape); when the last round overshoots, the coordinates to keep
/// are chosen by a seeded hash, so no part of the index space is favoured.
/// The nonzeros are in coordinate order.
///
/// Cost: O(nnz * nmodes) random draws and a parallel sort of the cell
/// numbers per round (usually two rounds); memory the tensor's plus 8
/// bytes per draw (16 beyond 2^64 cells), and one permutation per mode (4
/// bytes per index). Dimensions of more than 2^128 cells are refused.
pub fn power_law(spec: &PowerLawSpec) -> Result<SparseTensor> {
    check_dims(&spec.dims)?;
    if spec.nnz == 0 {
        return Err(FormatError::Argument(
            "nonzero count must be positive".into(),
        ));
    }
    if spec.exponents.len() != spec.dims.len() {
        return Err(FormatError::Argument(format!(
            "{} exponents for {} modes",
            spec.exponents.len(),
            spec.dims.len()
        )));
    }
    if let Some(s) = spec
        .exponents
        .iter()
        .find(|s| !(s.is_finite() && **s >= 0.0))
    {
        return Err(FormatError::Argument(format!(
            "Zipf exponent {s} must be finite and >= 0"
        )));
    }
    let cells: f64 = spec.dims.iter().map(|&d| f64::from(d)).product();
    if spec.exact && spec.nnz as f64 > cells {
        return Err(FormatError::Argument(format!(
            "{} nonzeros do not fit in {cells} cells",
            spec.nnz
        )));
    }
    let width = KeyWidth::of(&spec.dims);
    let need = power_law_bytes(&spec.dims, spec.nnz);
    if let Some(available) = memory::shortfall(need) {
        return Err(FormatError::Memory(format!(
            "generating {} nonzeros of dimensions {:?} needs about {} (the tensor, the draws and \
             one permutation per mode), and {} are available (MemAvailable)",
            spec.nnz,
            spec.dims,
            memory::bytes_text(need),
            memory::bytes_text(available)
        )));
    }
    let modes = spec
        .dims
        .iter()
        .zip(&spec.exponents)
        .enumerate()
        .map(|(mode, (&dim, &s))| ModeDraw::new(spec.seed, mode, dim, s))
        .collect::<Result<Vec<_>>>()?;

    let indices = match width {
        KeyWidth::U64 => distinct_draws::<u64>(spec, &modes)?,
        KeyWidth::U128 => distinct_draws::<u128>(spec, &modes)?,
        KeyWidth::Wider => {
            return Err(FormatError::Argument(format!(
                "dimensions {:?} have more than 2^128 cells, more than the generator numbers",
                spec.dims
            )));
        }
    };
    let mut values = vec![0f32; indices[0].len()];
    values
        .par_chunks_mut(BLOCK_NNZ)
        .enumerate()
        .for_each(|(b, out)| {
            let mut rng = ChaCha8Rng::seed_from_u64(stream_seed(spec.seed, 3, 0, b as u64));
            for v in out.iter_mut() {
                *v = rng.random::<f32>();
            }
        });
    // Distinct and in coordinate order: the check is one pass.
    SparseTensor::new(spec.dims.clone(), indices, values)
}

/// What [`power_law`] holds at its peak, in bytes: one permutation per
/// mode (4 bytes per index), and per nonzero the sorted cell numbers (and
/// their merge), the coordinates, the tensor's index columns and values.
pub fn power_law_bytes(dims: &[u32], nnz: usize) -> u64 {
    let key = match KeyWidth::of(dims) {
        KeyWidth::U64 => 8,
        _ => 16,
    };
    let perms = dims.iter().map(|&d| u64::from(d) * 4).sum::<u64>();
    let per_nonzero = 2 * key + 8 * dims.len() as u64 + 4;
    perms.saturating_add((nnz as u64).saturating_mul(per_nonzero))
}

/// `spec.nnz` distinct coordinates, in coordinate order: coordinates are
/// drawn, numbered by their cell (`K`), and the distinct cell numbers kept,
/// with more draws until there are enough; an overshoot is trimmed to the
/// cells whose seeded hash is lowest.
fn distinct_draws<K: Key>(spec: &PowerLawSpec, modes: &[ModeDraw]) -> Result<Vec<Vec<u32>>> {
    let draw = |first_block: usize, count: usize| -> Vec<K> {
        let cols: Vec<Vec<u32>> = modes
            .iter()
            .map(|m| m.draw(spec.seed, first_block, count))
            .collect();
        let mut keys: Vec<K> = (0..count)
            .into_par_iter()
            .map(|k| key_of::<K, _>(&cols, &spec.dims, k))
            .collect();
        keys.par_sort_unstable();
        keys.dedup();
        keys
    };
    let mut keys = draw(0, spec.nnz);
    let mut blocks = spec.nnz.div_ceil(BLOCK_NNZ);
    let mut drawn = spec.nnz;
    let mut rounds = 0;
    while spec.exact && keys.len() < spec.nnz {
        rounds += 1;
        if rounds > MAX_TOP_UP_ROUNDS {
            return Err(FormatError::Argument(format!(
                "found only {} distinct coordinates of the {} asked for after {} draws: \
                 the power law concentrates on too few cells; ask for fewer nonzeros",
                keys.len(),
                spec.nnz,
                drawn
            )));
        }
        // Draw what the yield of new coordinates so far says is missing,
        // with a margin that doubles each round (the yield falls as the
        // likely cells fill up), in whole blocks.
        let missing = spec.nnz - keys.len();
        let yield_rate = keys.len() as f64 / drawn as f64;
        let count = ((missing as f64 / yield_rate * 1.2) as usize)
            .saturating_mul(1 << (rounds - 1).min(20))
            .max(missing)
            .next_multiple_of(BLOCK_NNZ);
        let more = draw(blocks, count);
        blocks += count / BLOCK_NNZ;
        drawn += count;
        keys = merge_sorted(&keys, &more);
    }
    if keys.len() > spec.nnz {
        let mut ranked: Vec<(u64, K)> = keys
            .par_iter()
            .map(|&key| (stream_seed(spec.seed, 4, key.fold64(), 0), key))
            .collect();
        ranked.select_nth_unstable(spec.nnz - 1);
        ranked.truncate(spec.nnz);
        keys = ranked.into_par_iter().map(|(_, key)| key).collect();
        keys.par_sort_unstable();
    }
    let nmodes = spec.dims.len();
    let mut coords = vec![0u32; nmodes * keys.len()];
    coords
        .par_chunks_mut(nmodes)
        .zip(keys.par_iter())
        .for_each(|(out, &key)| coordinate_of(key, &spec.dims, out));
    Ok((0..nmodes)
        .map(|m| coords.par_iter().skip(m).step_by(nmodes).copied().collect())
        .collect())
}

/// The union of two sorted lists without repeats, sorted.
fn merge_sorted<K: Key>(a: &[K], b: &[K]) -> Vec<K> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                out.push(b[j]);
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

/// One mode's power law: a bounded Zipf law over ranks and the seeded
/// permutation that scatters the ranks over the indices.
struct ModeDraw {
    mode: usize,
    dim: u32,
    zipf: Zipf<f64>,
    perm: Vec<u32>,
}

impl ModeDraw {
    fn new(seed: u64, mode: usize, dim: u32, exponent: f64) -> Result<ModeDraw> {
        let mut perm: Vec<u32> = (0..dim).collect();
        perm.shuffle(&mut ChaCha8Rng::seed_from_u64(stream_seed(
            seed,
            1,
            mode as u64,
            0,
        )));
        let zipf = Zipf::new(f64::from(dim), exponent)
            .map_err(|e| FormatError::Argument(format!("mode {mode}: {e}")))?;
        Ok(ModeDraw {
            mode,
            dim,
            zipf,
            perm,
        })
    }

    /// `count` indices from the streams of blocks `first_block..`, so that
    /// each block's draws depend only on the seed, mode and block number.
    fn draw(&self, seed: u64, first_block: usize, count: usize) -> Vec<u32> {
        let mut idx = vec![0u32; count];
        idx.par_chunks_mut(BLOCK_NNZ)
            .enumerate()
            .for_each(|(b, out)| {
                let block = (first_block + b) as u64;
                let mut rng =
                    ChaCha8Rng::seed_from_u64(stream_seed(seed, 2, self.mode as u64, block));
                for slot in out.iter_mut() {
                    // Zipf yields a rank in [1, dim] as a float.
                    let rank = self.zipf.sample(&mut rng) as u64;
                    let rank = rank.clamp(1, u64::from(self.dim)) as usize;
                    *slot = self.perm[rank - 1];
                }
            });
        idx
    }
}

/// A tensor of the FROSTT collection: its names and shape. One list serves
/// `--like NAME` (a generated tensor of this shape) and `cargo xtask
/// fetch-frostt NAME` (the real one); either name finds it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Preset {
    /// The short name (`amazon`), the one shown in reports.
    pub name: &'static str,
    /// FROSTT's name, that of its file (`amazon-reviews.tns.gz`); the same
    /// as `name` where FROSTT's is short.
    pub frostt: &'static str,
    pub dims: &'static [u32],
    /// The real tensor's nonzero count, where FROSTT's is recorded here
    /// (`None` for the three-mode sums of delicious, flickr and vast, whose
    /// counts FROSTT's listing does not give).
    pub nnz: Option<u64>,
}

impl Preset {
    /// `given`, else the real tensor's count; an error when neither is
    /// known.
    pub fn nnz_or(&self, given: Option<usize>) -> Result<usize> {
        match (given, self.nnz) {
            (Some(n), _) => Ok(n),
            (None, Some(n)) => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
            (None, None) => Err(FormatError::Argument(format!(
                "the nonzero count of {} is not recorded",
                self.name
            ))
            .advise(crate::Advice::GiveNnz)),
        }
    }

    /// Whether `name` is one of this tensor's names (case-insensitive).
    pub fn is_named(&self, name: &str) -> bool {
        self.name.eq_ignore_ascii_case(name) || self.frostt.eq_ignore_ascii_case(name)
    }
}

/// Shorthand for the table below.
const fn frostt(
    name: &'static str,
    frostt: &'static str,
    dims: &'static [u32],
    nnz: Option<u64>,
) -> Preset {
    Preset {
        name,
        frostt,
        dims,
        nnz,
    }
}

/// The FROSTT tensors (frostt.io), with the shapes and nonzero counts the
/// collection publishes. `xtask/frostt-manifest.json` has the download of
/// each `frostt` name, and its tests check that the two lists agree.
pub const PRESETS: &[Preset] = &[
    frostt(
        "nell-2",
        "nell-2",
        &[12_092, 9_184, 28_818],
        Some(76_879_419),
    ),
    frostt(
        "nell-1",
        "nell-1",
        &[2_902_330, 2_143_368, 25_495_389],
        Some(143_599_552),
    ),
    frostt(
        "delicious-4d",
        "delicious-4d",
        &[532_924, 17_262_471, 2_480_308, 1_443],
        Some(140_126_181),
    ),
    frostt(
        "delicious-3d",
        "delicious-3d",
        &[532_924, 17_262_471, 2_480_308],
        None,
    ),
    frostt(
        "flickr-4d",
        "flickr-4d",
        &[319_686, 28_153_045, 1_607_191, 731],
        Some(112_890_310),
    ),
    frostt(
        "flickr-3d",
        "flickr-3d",
        &[319_686, 28_153_045, 1_607_191],
        None,
    ),
    frostt(
        "enron",
        "enron",
        &[6_066, 5_699, 244_268, 1_176],
        Some(54_202_099),
    ),
    frostt(
        "vast-5d",
        "vast-2015-mc1-5d",
        &[165_427, 11_374, 2, 100, 89],
        Some(26_021_945),
    ),
    frostt("vast-3d", "vast-2015-mc1-3d", &[165_427, 11_374, 2], None),
    frostt("nips", "nips", &[2_482, 2_862, 14_036, 17], Some(3_101_609)),
    frostt("uber", "uber", &[183, 24, 1_140, 1_717], Some(3_309_490)),
    frostt(
        "chicago-crime",
        "chicago-crime-comm",
        &[6_186, 24, 77, 32],
        Some(5_330_673),
    ),
    frostt(
        "lbnl",
        "lbnl-network",
        &[1_605, 4_198, 1_631, 4_209, 868_131],
        Some(1_698_825),
    ),
    frostt(
        "amazon",
        "amazon-reviews",
        &[4_821_207, 1_774_269, 1_805_187],
        Some(1_741_809_018),
    ),
    frostt(
        "patents",
        "patents",
        &[46, 239_172, 239_172],
        Some(3_596_640_708),
    ),
    frostt(
        "reddit",
        "reddit-2015",
        &[8_211_298, 176_962, 8_116_559],
        Some(4_687_474_081),
    ),
    frostt(
        "fb-m",
        "fb-m",
        &[23_344_784, 23_344_784, 166],
        Some(99_546_551),
    ),
    frostt(
        "1998darpa",
        "1998darpa",
        &[22_476, 22_476, 23_776_223],
        Some(28_436_033),
    ),
    frostt(
        "lanl2",
        "lanl2",
        &[3_761, 11_154, 8_711, 75_147, 9],
        Some(69_082_467),
    ),
];

/// Looks a tensor up by either of its names (case-insensitive).
pub fn preset(name: &str) -> Result<&'static Preset> {
    PRESETS.iter().find(|p| p.is_named(name)).ok_or_else(|| {
        let names: Vec<String> = PRESETS
            .iter()
            .map(|p| {
                if p.name == p.frostt {
                    p.name.to_string()
                } else {
                    format!("{} ({})", p.name, p.frostt)
                }
            })
            .collect();
        FormatError::Argument(format!(
            "unknown tensor '{name}'; known: {}",
            names.join(", ")
        ))
    })
}

/// A planted low-rank tensor: the exact sum of `rank` sparse rank-one
/// components, plus optional noise on the stored values.
///
/// Component `r` is nonzero only on a random support of `s_m` indices in each
/// mode `m`, so the tensor is sparse *and* exactly of rank `rank`: sampling
/// random cells of a dense low-rank model instead would make every unsampled
/// cell a zero the model does not predict, and no rank-R fit could be good.
/// The support sizes are chosen so that the tensor has about `nnz` nonzeros
/// (fewer where supports overlap: coinciding cells are summed).
#[derive(Clone, Debug, PartialEq)]
pub struct PlantedSpec {
    pub dims: Vec<u32>,
    pub rank: usize,
    pub nnz: usize,
    /// Relative Gaussian noise: each value `x` becomes `x * (1 + noise * e)`,
    /// `e ~ N(0, 1)`.
    pub noise: f64,
    pub seed: u64,
}

/// A planted tensor and the factors it was built from.
#[derive(Clone, Debug)]
pub struct Planted {
    pub tensor: SparseTensor,
    /// Component weights (all 1: the factors carry the scale).
    pub lambda: Vec<f64>,
    /// One `dims[m] x rank` matrix per mode; zero outside each support.
    pub factors: Vec<Array2<f32>>,
}

/// Support sizes per mode whose product is about `per_component`, each at
/// most the mode's dimension.
fn support_sizes(dims: &[u32], per_component: f64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..dims.len()).collect();
    order.sort_by_key(|&m| dims[m]);
    let mut sizes = vec![1usize; dims.len()];
    let mut remaining = per_component.max(1.0);
    for (k, &m) in order.iter().enumerate() {
        let modes_left = (dims.len() - k) as f64;
        let want = remaining.powf(1.0 / modes_left).round().max(1.0);
        let size = (want as usize).min(dims[m] as usize);
        sizes[m] = size;
        remaining /= size as f64;
    }
    sizes
}

/// Generates a planted low-rank tensor (see [`PlantedSpec`]).
///
/// Cost: O(nnz * nmodes) plus a sort to merge overlapping cells.
pub fn planted(spec: &PlantedSpec) -> Result<Planted> {
    check_dims(&spec.dims)?;
    if spec.rank == 0 || spec.nnz == 0 {
        return Err(FormatError::Argument(
            "rank and nonzero count must be positive".into(),
        ));
    }
    if !(spec.noise.is_finite() && spec.noise >= 0.0) {
        return Err(FormatError::Argument(format!(
            "noise {} must be finite and >= 0",
            spec.noise
        )));
    }
    let nmodes = spec.dims.len();
    // The factors (f32, every row) and twice the tensor (built, then
    // summed where supports overlap).
    let rows: u64 = spec.dims.iter().map(|&d| u64::from(d)).sum();
    let need = rows
        .saturating_mul(spec.rank as u64)
        .saturating_mul(4)
        .saturating_add(memory::coo_bytes(nmodes, spec.nnz as u64).saturating_mul(2));
    if let Some(available) = memory::shortfall(need) {
        return Err(FormatError::Memory(format!(
            "generating a planted rank-{} tensor of dimensions {:?} and {} nonzeros needs about \
             {} (its factors and nonzeros), and {} are available (MemAvailable)",
            spec.rank,
            spec.dims,
            spec.nnz,
            memory::bytes_text(need),
            memory::bytes_text(available)
        )));
    }
    let sizes = support_sizes(&spec.dims, spec.nnz as f64 / spec.rank as f64);
    let mut rng = ChaCha8Rng::seed_from_u64(stream_seed(spec.seed, 4, 0, 0));

    let mut factors: Vec<Array2<f32>> = spec
        .dims
        .iter()
        .map(|&d| Array2::zeros((d as usize, spec.rank)))
        .collect();
    // supports[r][m]: the indices where component r is nonzero in mode m.
    let mut supports = vec![Vec::with_capacity(nmodes); spec.rank];
    for (r, support) in supports.iter_mut().enumerate() {
        for (m, factor) in factors.iter_mut().enumerate() {
            let picked = rand::seq::index::sample(&mut rng, spec.dims[m] as usize, sizes[m]);
            let mut idx: Vec<u32> = picked.iter().map(|i| i as u32).collect();
            idx.sort_unstable();
            for &i in &idx {
                factor[[i as usize, r]] = rng.random_range(0.5f32..1.5);
            }
            support.push(idx);
        }
    }

    let per_component: usize = sizes.iter().product();
    let total = per_component * spec.rank;
    let mut indices = vec![Vec::with_capacity(total); nmodes];
    let mut values = Vec::with_capacity(total);
    let mut pos = vec![0usize; nmodes];
    for (r, support) in supports.iter().enumerate() {
        // Walk the Cartesian product of the supports like an odometer.
        pos.iter_mut().for_each(|p| *p = 0);
        loop {
            let mut v = 1f32;
            for m in 0..nmodes {
                let i = support[m][pos[m]];
                indices[m].push(i);
                v *= factors[m][[i as usize, r]];
            }
            values.push(v);
            let mut m = nmodes;
            loop {
                if m == 0 {
                    break;
                }
                m -= 1;
                pos[m] += 1;
                if pos[m] < support[m].len() {
                    break;
                }
                pos[m] = 0;
            }
            if pos.iter().all(|&p| p == 0) {
                break;
            }
        }
    }
    if spec.noise > 0.0 {
        let normal = Normal::new(0.0, spec.noise)
            .map_err(|e| FormatError::Argument(format!("noise: {e}")))?;
        for v in &mut values {
            *v *= (1.0 + normal.sample(&mut rng)) as f32;
        }
    }
    let tensor = SparseTensor::new(spec.dims.clone(), indices, values)?;
    Ok(Planted {
        tensor,
        lambda: vec![1.0; spec.rank],
        factors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_law_is_deterministic_and_in_range() {
        let spec = PowerLawSpec::new(vec![100, 50, 70, 30], 200_000).with_seed(9);
        let a = power_law(&spec).unwrap();
        let b = power_law(&spec).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.nnz(), 200_000);
        let c = power_law(&spec.clone().with_seed(10)).unwrap();
        assert_ne!(a, c);
        assert!(a.values().iter().all(|&v| (0.0..1.0).contains(&v)));
    }

    #[test]
    fn power_law_is_skewed_like_zipf() {
        // With s = 1.1 over 10,000 indices the top rank has probability
        // 1 / H(10000, 1.1) ~ 0.15; with s = 0 indices are uniform (over a
        // million, so that few draws of the hot row repeat a coordinate).
        let mut spec = PowerLawSpec::new(vec![10_000, 1_000_000], 400_000);
        spec.exponents = vec![1.1, 0.0];
        let t = power_law(&spec).unwrap();
        let stats = t.stats();
        let hot0 = stats.modes[0].degree_max as f64 / t.nnz() as f64;
        let hot1 = stats.modes[1].degree_max as f64 / t.nnz() as f64;
        assert!((0.12..0.19).contains(&hot0), "hottest share {hot0}");
        assert!(hot1 < 0.001, "uniform mode hottest share {hot1}");
    }

    #[test]
    fn power_law_coordinates_are_distinct_and_as_many_as_asked() {
        // A nell-2 shape draws about a quarter of its coordinates twice.
        for nnz in [1usize, 1000, 100_000] {
            let spec = PowerLawSpec::new(vec![12_092, 9_184, 28_818], nnz).with_seed(3);
            let t = power_law(&spec).unwrap();
            assert_eq!(t.nnz(), nnz);
            let mut coords: Vec<(u32, u32, u32)> = (0..nnz)
                .map(|k| (t.indices()[0][k], t.indices()[1][k], t.indices()[2][k]))
                .collect();
            // Built in coordinate order, with no coordinate twice.
            assert!(coords.windows(2).all(|w| w[0] < w[1]));
            coords.dedup();
            assert_eq!(coords.len(), nnz);
        }
        // Every cell of a tiny tensor, and no more.
        let t = power_law(&PowerLawSpec::new(vec![3, 3], 9)).unwrap();
        assert_eq!(t.nnz(), 9);
        let err = power_law(&PowerLawSpec::new(vec![3, 3], 10)).unwrap_err();
        assert!(err.to_string().contains("do not fit in 9 cells"), "{err}");
    }

    #[test]
    fn power_law_by_draws_keeps_the_distinct_ones() {
        let spec = PowerLawSpec::new(vec![5, 4, 3], 500).with_draws();
        let t = power_law(&spec).unwrap();
        // 500 draws over 60 cells: as many distinct ones as were drawn.
        assert!(t.nnz() <= 60 && t.nnz() > 10, "{}", t.nnz());
        assert_eq!(t, power_law(&spec).unwrap());
    }

    #[test]
    fn power_law_rejects_bad_specs() {
        // More than memory holds: refused before anything is drawn.
        let huge = PowerLawSpec::new(vec![u32::MAX, u32::MAX], 100_000_000_000);
        if memory::available_bytes().is_some() {
            let start = std::time::Instant::now();
            assert!(matches!(power_law(&huge), Err(FormatError::Memory(_))));
            let huge = PlantedSpec {
                dims: vec![u32::MAX, u32::MAX],
                rank: 10,
                nnz: 1000,
                noise: 0.0,
                seed: 1,
            };
            assert!(matches!(planted(&huge), Err(FormatError::Memory(_))));
            assert!(start.elapsed().as_secs() < 2);
        }
        assert_eq!(
            power_law_bytes(&[1000, 1000], 10),
            2000 * 4 + 10 * (2 * 8 + 2 * 8 + 4)
        );
        assert!(power_law(&PowerLawSpec::new(vec![10], 10)).is_err());
        assert!(power_law(&PowerLawSpec::new(vec![10, 0], 10)).is_err());
        assert!(power_law(&PowerLawSpec::new(vec![10, 10], 0)).is_err());
        let mut bad = PowerLawSpec::new(vec![10, 10], 10);
        bad.exponents = vec![1.0, f64::NAN];
        assert!(power_law(&bad).is_err());
    }

    #[test]
    fn presets_are_found_by_name() {
        let p = preset("NELL-2").unwrap();
        assert_eq!(p.dims, &[12_092, 9_184, 28_818]);
        assert!(preset("nell-3").unwrap_err().to_string().contains("nell-2"));
        let spec = PowerLawSpec::like(preset("vast-5d").unwrap(), Some(1000)).unwrap();
        assert_eq!(power_law(&spec).unwrap().nmodes(), 5);
        // FROSTT's names find the same tensors as the short ones.
        for (short, long) in [
            ("amazon", "amazon-reviews"),
            ("reddit", "reddit-2015"),
            ("chicago-crime", "chicago-crime-comm"),
            ("vast-5d", "vast-2015-mc1-5d"),
        ] {
            assert_eq!(preset(short).unwrap(), preset(long).unwrap());
        }
        // Every name is one tensor's only.
        let mut seen = std::collections::HashSet::new();
        for p in PRESETS {
            assert!(seen.insert(p.name.to_ascii_lowercase()), "{}", p.name);
            if p.frostt != p.name {
                assert!(seen.insert(p.frostt.to_ascii_lowercase()), "{}", p.frostt);
            }
        }
        // A tensor whose count is not recorded needs one.
        let p = preset("delicious-3d").unwrap();
        let e = PowerLawSpec::like(p, None).unwrap_err();
        assert!(
            e.to_string().ends_with("is not recorded: give one (nnz)"),
            "{e}"
        );
        assert!(
            e.message(&crate::tns::test_util::dashed)
                .ends_with("is not recorded: give one (--nnz)"),
            "{e}"
        );
        assert_eq!(p.nnz_or(Some(5)).unwrap(), 5);
    }

    #[test]
    fn planted_tensor_equals_its_model() {
        let spec = PlantedSpec {
            dims: vec![40, 30, 20],
            rank: 3,
            nnz: 3_000,
            noise: 0.0,
            seed: 5,
        };
        let p = planted(&spec).unwrap();
        let t = &p.tensor;
        assert!(t.nnz() > 1_000 && t.nnz() <= 3_000, "nnz {}", t.nnz());
        // Every stored value equals the model's value at that cell.
        for k in 0..t.nnz() {
            let model: f32 = (0..spec.rank)
                .map(|r| {
                    (0..3)
                        .map(|m| p.factors[m][[t.mode_indices(m)[k] as usize, r]])
                        .product::<f32>()
                })
                .sum();
            assert!((model - t.values()[k]).abs() <= 1e-5 * model.abs());
        }
        // The model has no mass outside the stored cells: compare norms.
        let model_norm_sq: f64 = (0..spec.rank)
            .flat_map(|a| (0..spec.rank).map(move |b| (a, b)))
            .map(|(a, b)| {
                (0..3)
                    .map(|m| {
                        let f = &p.factors[m];
                        (0..f.nrows())
                            .map(|i| f64::from(f[[i, a]]) * f64::from(f[[i, b]]))
                            .sum::<f64>()
                    })
                    .product::<f64>()
            })
            .sum();
        assert!((model_norm_sq - t.norm_sq()).abs() <= 1e-4 * model_norm_sq);
    }

    #[test]
    fn support_sizes_respect_small_modes() {
        let sizes = support_sizes(&[2, 1000, 1000], 5000.0);
        assert_eq!(sizes[0], 2);
        let product: usize = sizes.iter().product();
        assert!((4000..=6000).contains(&product), "{sizes:?}");
    }
}

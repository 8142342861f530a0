//! Seeded uniform initial factors drawn on the device (`uniform_fill` in
//! `kernels/dense.cu`) instead of drawn on the host and uploaded: at tens
//! of millions of rows the host's draw and the copy of gigabytes cost a
//! second, the kernel milliseconds.
//!
//! The draw is kruskal-cpd's `random_factors`, bit for bit: mode `m` of
//! `dims[m] x rank` floats comes in blocks of `block` floats, block `k`
//! from the ChaCha8 keystream keyed by the seed (expanded to 32 bytes as
//! `rand_core`'s `seed_from_u64` does, by PCG32) with the 64-bit nonce
//! `(m << 40) | k` and the block counter from 0; each 32-bit word `w` gives
//! the float `(w >> 8) * 2^-24` in [0, 1). [`uniform_host`] computes the
//! same numbers on the host: the tests hold it against the host's draw
//! and the kernel against it.

/// The nonce of mode `mode`'s first block (`mode << 40`).
pub fn mode_stream(mode: usize) -> u64 {
    (mode as u64) << 40
}

/// The 256-bit key of `seed`: eight words of PCG32 (state advanced
/// before each output), as `rand_core::SeedableRng::seed_from_u64`
/// expands a seed.
pub fn chacha_key(seed: u64) -> [u32; 8] {
    const MUL: u64 = 6364136223846793005;
    const INC: u64 = 11634580027462260723;
    let mut state = seed;
    std::array::from_fn(|_| {
        state = state.wrapping_mul(MUL).wrapping_add(INC);
        let xorshifted = (((state >> 18) ^ state) >> 27) as u32;
        xorshifted.rotate_right((state >> 59) as u32)
    })
}

fn quarter_round(x: &mut [u32; 16], [a, b, c, d]: [usize; 4]) {
    x[a] = x[a].wrapping_add(x[b]);
    x[d] = (x[d] ^ x[a]).rotate_left(16);
    x[c] = x[c].wrapping_add(x[d]);
    x[b] = (x[b] ^ x[c]).rotate_left(12);
    x[a] = x[a].wrapping_add(x[b]);
    x[d] = (x[d] ^ x[a]).rotate_left(8);
    x[c] = x[c].wrapping_add(x[d]);
    x[b] = (x[b] ^ x[c]).rotate_left(7);
}

/// One 16-word ChaCha8 block: key, 64-bit block counter, 64-bit nonce.
pub fn chacha8_block(key: &[u32; 8], counter: u64, nonce: u64) -> [u32; 16] {
    let mut input = [0u32; 16];
    input[..4].copy_from_slice(&[0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574]);
    input[4..12].copy_from_slice(key);
    input[12..].copy_from_slice(&[
        counter as u32,
        (counter >> 32) as u32,
        nonce as u32,
        (nonce >> 32) as u32,
    ]);
    let mut x = input;
    for _ in 0..4 {
        for q in [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]] {
            quarter_round(&mut x, q);
        }
        for q in [[0, 5, 10, 15], [1, 6, 11, 12], [2, 7, 8, 13], [3, 4, 9, 14]] {
            quarter_round(&mut x, q);
        }
    }
    std::array::from_fn(|i| x[i].wrapping_add(input[i]))
}

/// The float a keystream word gives: its top 24 bits times 2^-24.
pub fn unit_float(word: u32) -> f32 {
    (word >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// `n` floats of the draw with key `key` and first nonce `stream`, in
/// blocks of `block` floats (a multiple of 16), on the host: what
/// `uniform_fill` writes.
pub fn uniform_host(key: &[u32; 8], stream: u64, block: usize, n: usize) -> Vec<f32> {
    assert!(
        block > 0 && block % 16 == 0,
        "block must be a positive multiple of 16"
    );
    (0..n.div_ceil(16))
        .flat_map(|g| {
            let e0 = g * 16;
            let words = chacha8_block(
                key,
                ((e0 % block) / 16) as u64,
                stream | (e0 / block) as u64,
            );
            words.into_iter().take(n - e0).map(unit_float)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_function_gives_the_reference_keystream() {
        // ChaCha with a zero key, counter and nonce: the first words of the
        // 8-round keystream (Bernstein's reference, as published in the
        // test vectors of the ChaCha8 variant).
        let block = chacha8_block(&[0; 8], 0, 0);
        let bytes: Vec<u8> = block.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(
            bytes[..16],
            [
                0x3e, 0x00, 0xef, 0x2f, 0x89, 0x5f, 0x40, 0xd6, 0x7f, 0x5b, 0xb8, 0xe8, 0x1f, 0x09,
                0xa5, 0xa1
            ]
        );
    }

    #[test]
    fn floats_lie_in_the_unit_interval_and_blocks_restart_the_counter() {
        let key = chacha_key(7);
        let x = uniform_host(&key, mode_stream(1), 32, 80);
        assert_eq!(x.len(), 80);
        assert!(x.iter().all(|&v| (0.0..1.0).contains(&v)));
        // Floats 32..48 open block 1: counter 0 of nonce stream | 1.
        let b1 = chacha8_block(&key, 0, mode_stream(1) | 1);
        assert_eq!(x[32..48], b1.map(unit_float));
        assert_eq!(unit_float(u32::MAX), 1.0 - 1.0 / (1u32 << 24) as f32);
        assert_eq!(unit_float(255), 0.0);
    }
}

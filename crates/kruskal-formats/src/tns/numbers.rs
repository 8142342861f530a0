//! Value parsing: an exact fast path for plain decimals, and the standard
//! parser for everything else.

use super::parse::show;

/// Powers of ten exactly representable in f32.
const POW10_F32: [f32; 11] = [1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10];

/// Powers of ten exactly representable in f64.
const POW10_F64: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

/// Parses a value: plain decimals with at most 17 digits take an exact fast
/// path (see [`fast_value`]); anything else goes to the standard parser.
#[inline]
pub(super) fn parse_value(tok: &[u8]) -> std::result::Result<f32, String> {
    if let Some(v) = fast_value(tok) {
        return Ok(v);
    }
    let parsed = std::str::from_utf8(tok)
        .ok()
        .and_then(|s| s.parse::<f32>().ok());
    match parsed {
        Some(v) if v.is_finite() => Ok(v),
        Some(_) => Err(format!(
            "value `{}` is not a finite number (NaN and infinity are not allowed, and f32 \
             overflows beyond 3.4e38)",
            show(tok)
        )),
        None => Err(format!("value `{}` is not a number", show(tok))),
    }
}

#[inline]
fn fast_value(tok: &[u8]) -> Option<f32> {
    let (neg, digits) = match tok.first()? {
        b'-' => (true, &tok[1..]),
        b'+' => (false, &tok[1..]),
        _ => (false, tok),
    };
    if digits.is_empty() || digits.len() > 18 {
        return None;
    }
    let mut mantissa: u64 = 0;
    let mut frac: Option<usize> = None;
    let mut ndigits = 0;
    for &c in digits {
        if c.is_ascii_digit() {
            mantissa = mantissa * 10 + u64::from(c - b'0');
            ndigits += 1;
            if let Some(f) = &mut frac {
                *f += 1;
            }
        } else if c == b'.' && frac.is_none() {
            frac = Some(0);
        } else {
            return None;
        }
    }
    let frac = frac.unwrap_or(0);
    if ndigits == 0 {
        return None;
    }
    let v = if mantissa < 1 << 24 && frac < POW10_F32.len() {
        // Both are exact f32s: one correctly rounded f32 division.
        mantissa as f32 / POW10_F32[frac]
    } else if mantissa < 1 << 53 && frac < POW10_F64.len() {
        // Both are exact f64s, so `q` is the quotient correctly rounded to
        // f64. Every boundary between f32 roundings (a midpoint between
        // neighbouring f32s, 25 significant bits) is an f64, and rounding
        // is monotonic, so `q` and the exact quotient round to the same f32
        // unless `q` lies on a boundary: then the quotient may have been
        // just off it, and the standard parser decides. (`q` is 0 or
        // between 1e-22 and 2^53, normal as an f32, so the 29 low bits of
        // its significand are the ones rounding to f32 drops.)
        let q = mantissa as f64 / POW10_F64[frac];
        if q.to_bits() & ((1 << 29) - 1) == 1 << 28 {
            return None;
        }
        q as f32
    } else {
        return None;
    };
    Some(if neg { -v } else { v })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::ReadOptions;
    use crate::tns::test_util::parse_err;

    #[test]
    fn fast_value_agrees_with_std() {
        for s in [
            "0",
            "4",
            "-4",
            "4.000000",
            "0.237788",
            "0.845814",
            "123456.7",
            "16777215",
            "16777216",
            "9.999999",
            "0.1",
            "0.3",
            "-0.0",
            "1.",
            ".25",
            "3.4028235e38",
            "0.0000000001",
            "00012.5000",
        ] {
            let want: f32 = s.parse().unwrap();
            assert_eq!(
                parse_value(s.as_bytes()).unwrap().to_bits(),
                want.to_bits(),
                "{s}"
            );
        }
    }

    #[test]
    fn fast_value_agrees_with_std_on_many_values() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let check = |s: &str| {
            let want: f32 = s.parse().unwrap();
            let got = parse_value(s.as_bytes()).unwrap();
            assert_eq!(got.to_bits(), want.to_bits(), "{s}");
        };
        for _ in 0..200_000 {
            // Random digit strings with a random point.
            let n = rng.random_range(1..=18);
            let mut s: String = (0..n)
                .map(|_| char::from(b'0' + rng.random_range(0..10u8)))
                .collect();
            if rng.random_bool(0.8) {
                s.insert(rng.random_range(0..=n), '.');
            }
            check(&s);
            // f32s as the writer prints them.
            let x = f32::from_bits(rng.random_range(0x2000_0000..0x5f00_0000u32));
            check(&x.to_string());
            check(&format!("-{x}"));
        }
        // Decimals near the midpoints between neighbouring f32s, where
        // rounding twice could go wrong.
        for _ in 0..20_000 {
            let a = f32::from_bits(rng.random_range(0x3000_0000..0x5a00_0000u32));
            let b = f32::from_bits(a.to_bits() + 1);
            let mid = (f64::from(a) + f64::from(b)) / 2.0;
            for prec in 0..=22 {
                check(&format!("{mid:.prec$}"));
            }
        }
        for s in [
            "16777217",
            "16777217.00000001",
            "1.000000059604645",
            "33554435",
        ] {
            check(s);
        }
    }

    #[test]
    fn bad_values() {
        let o = ReadOptions::default();
        let (line, msg) = parse_err("1 1 1.0\n1 2 abc\n", &o);
        assert_eq!(line, 2);
        assert!(msg.contains("value `abc` is not a number"), "{msg}");
        for bad in ["nan", "NaN", "inf", "-infinity", "1e39"] {
            let (line, msg) = parse_err(&format!("1 1 1.0\n1 1 2\n1 2 {bad}\n"), &o);
            assert_eq!(line, 3, "{bad}");
            assert!(msg.contains("is not a finite number"), "{bad}: {msg}");
        }
    }
}

//! The host memory a process may still allocate, read before anything
//! large is: a file (or a generator's arguments) can ask for far more than
//! the machine has, and allocating first means the out-of-memory killer
//! ends the process without a word.

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") | None => Some(kib * 1024),
        Some(_) => None,
    }
}

/// The memory this process can still allocate: what the kernel says can
/// be allocated without swapping (`MemAvailable` in `/proc/meminfo`),
/// less where a limit of this process is lower: the room left under its
/// cgroup's `memory.max` (and its parents'), and under its address-space
/// limit (`ulimit -v`). `None` where `/proc/meminfo` is missing (not
/// Linux) or unreadable, and callers then skip the check.
pub fn available_bytes() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let mut room = parse_meminfo(&read("/proc/meminfo")?)?;
    if let Some(c) = read("/proc/self/cgroup").and_then(|text| cgroup_room(&text)) {
        room = room.min(c);
    }
    let limit = read("/proc/self/limits").and_then(|t| parse_address_limit(&t));
    let used = read("/proc/self/status").and_then(|t| parse_vm_size(&t));
    if let (Some(limit), Some(used)) = (limit, used) {
        room = room.min(limit.saturating_sub(used));
    }
    Some(room)
}

/// The soft address-space limit of a `/proc/self/limits` text, in bytes
/// (`None` when unlimited).
pub fn parse_address_limit(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max address space"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// `VmSize` of a `/proc/self/status` text, in bytes.
pub fn parse_vm_size(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("VmSize:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The room under the cgroup v2 memory limits of the group named in a
/// `/proc/self/cgroup` text and its parents: the smallest `memory.max`
/// less `memory.current`. `None` without cgroup v2 or without a limit.
fn cgroup_room(text: &str) -> Option<u64> {
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let root = std::path::Path::new("/sys/fs/cgroup");
    let mut dir = root.join(path.trim_start_matches('/'));
    let mut room: Option<u64> = None;
    loop {
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        let max = read("memory.max").and_then(|t| t.trim().parse::<u64>().ok());
        let current = read("memory.current").and_then(|t| t.trim().parse::<u64>().ok());
        if let (Some(max), Some(current)) = (max, current) {
            let here = max.saturating_sub(current);
            room = Some(room.map_or(here, |r| r.min(here)));
        }
        if dir == root || !dir.pop() || !dir.starts_with(root) {
            return room;
        }
    }
}

/// The available bytes when `need` exceeds them (`None` when it fits, or
/// when the available memory cannot be read).
pub fn shortfall(need: u64) -> Option<u64> {
    available_bytes().filter(|&available| need > available)
}

/// `12.3 GiB`, `45.6 MiB`, `512.4 KiB` or `789 bytes`.
pub fn bytes_text(bytes: u64) -> String {
    const KIB: f64 = (1u64 << 10) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    const GIB: f64 = (1u64 << 30) as f64;
    let b = bytes as f64;
    if b >= GIB {
        format!("{:.1} GiB", b / GIB)
    } else if b >= MIB {
        format!("{:.1} MiB", b / MIB)
    } else if b >= KIB {
        format!("{:.1} KiB", b / KIB)
    } else {
        format!("{bytes} bytes")
    }
}

/// Bytes of a COO tensor's arrays: a u32 index per mode and an f32 value
/// per nonzero.
pub fn coo_bytes(nmodes: usize, nnz: u64) -> u64 {
    nnz.saturating_mul(4 * nmodes as u64 + 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_limits_are_read_in_bytes() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max cpu time              unlimited            unlimited            seconds\n\
                      Max address space         8589934592           unlimited            bytes\n";
        assert_eq!(parse_address_limit(limits), Some(8 << 30));
        let unlimited =
            "Max address space         unlimited            unlimited            bytes\n";
        assert_eq!(parse_address_limit(unlimited), None);
        let status = "Name:\tkruskal\nVmPeak:\t  200 kB\nVmSize:\t   123456 kB\n";
        assert_eq!(parse_vm_size(status), Some(123_456 * 1024));
        assert_eq!(parse_vm_size("Name: x\n"), None);
        assert_eq!(cgroup_room("1:cpu:/x\n"), None);
    }

    #[test]
    fn shortfalls_are_measured_against_mem_available() {
        assert_eq!(shortfall(0), None);
        if let Some(available) = available_bytes() {
            assert_eq!(shortfall(u64::MAX), Some(available));
        }
        assert_eq!(coo_bytes(3, 10), 160);
        assert_eq!(coo_bytes(64, u64::MAX), u64::MAX);
    }
}

//! Which rank this process is, read from the variables a launcher sets.
//!
//! The first family of variables that gives a rank wins:
//!
//! 1. kruskal's own: `KRUSKAL_RANK`, `KRUSKAL_WORLD_SIZE`,
//!    `KRUSKAL_LOCAL_GPU`, `KRUSKAL_RENDEZVOUS=host:port`;
//! 2. torchrun's: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//!    `MASTER_PORT`;
//! 3. OpenMPI's: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//!    `OMPI_COMM_WORLD_LOCAL_RANK`;
//! 4. Slurm's: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`.
//!
//! (OpenMPI comes before Slurm because `mpirun` inside a Slurm allocation
//! leaves the allocation's `SLURM_PROCID` in every rank's environment.)
//!
//! The local GPU is the family's local rank unless `KRUSKAL_LOCAL_GPU`
//! says otherwise; `KRUSKAL_WORLD_SIZE`, when set beside another family,
//! must agree with it. The rendezvous address is `KRUSKAL_RENDEZVOUS`, or
//! else `MASTER_ADDR:MASTER_PORT`. The job token is `KRUSKAL_JOB_TOKEN`.
//! [`LaunchOverrides`] (explicit values, e.g. the command line's flags) win
//! over all of these; messages about them use the caller's
//! [`OverrideNames`].
//!
//! Parsing is strict: a value that is not a plain decimal number, a rank
//! not below the world size, a port outside 1..=65535 or half of a pair
//! is an error naming the variable and its value.

use std::fmt;

use super::{LaunchError, Result};

/// The fewest characters a job token may have. The token is the key of
/// every authentication code; `openssl rand -hex 16` gives 32 characters
/// (128 random bits).
pub const MIN_TOKEN_CHARS: usize = 16;

const TOKEN_VAR: &str = "KRUSKAL_JOB_TOKEN";
const TOKEN_HOWTO: &str = "every rank of a job needs the same secret token: create one \
     with `openssl rand -hex 16` and export it as KRUSKAL_JOB_TOKEN on every rank (e.g. \
     `export KRUSKAL_JOB_TOKEN=$(openssl rand -hex 16)` once in the job script, before \
     the ranks start)";

/// One launcher's variables.
struct Family {
    source: &'static str,
    rank: &'static str,
    size: &'static str,
    local: &'static str,
}

const KRUSKAL: Family = Family {
    source: "KRUSKAL_* variables",
    rank: "KRUSKAL_RANK",
    size: "KRUSKAL_WORLD_SIZE",
    local: "KRUSKAL_LOCAL_GPU",
};

const FAMILIES: [Family; 4] = [
    KRUSKAL,
    Family {
        source: "torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK)",
        rank: "RANK",
        size: "WORLD_SIZE",
        local: "LOCAL_RANK",
    },
    Family {
        source: "OpenMPI variables (OMPI_COMM_WORLD_*)",
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local: "OMPI_COMM_WORLD_LOCAL_RANK",
    },
    Family {
        source: "Slurm variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID)",
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local: "SLURM_LOCALID",
    },
];

/// A host name or address and a TCP port. IPv6 addresses are kept without
/// brackets and shown with them (`[::1]:29500`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

impl HostPort {
    /// Parses `host:port` or `[ipv6]:port`; `var` names where the text
    /// came from (a variable, a flag or words such as "an explicit
    /// rendezvous address"), for the error.
    pub fn parse(var: &'static str, text: &str) -> Result<HostPort> {
        let invalid = |problem: &str| LaunchError::Invalid {
            var,
            value: text.to_string(),
            problem: problem.to_string(),
        };
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            rest.split_once("]:")
                .ok_or_else(|| invalid("expected [address]:port"))?
        } else {
            let (host, port) = text
                .rsplit_once(':')
                .ok_or_else(|| invalid("expected host:port, e.g. node01:29500"))?;
            if host.contains(':') {
                return Err(invalid("an IPv6 address needs brackets: [address]:port"));
            }
            (host, port)
        };
        check_host(host).map_err(invalid)?;
        let port = parse_port(port).map_err(invalid)?;
        Ok(HostPort {
            host: host.to_string(),
            port,
        })
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// This process's place in a job of several processes.
#[derive(Clone, PartialEq, Eq)]
pub struct Launch {
    /// 0..world_size; rank 0 hosts the rendezvous.
    pub rank: usize,
    pub world_size: usize,
    /// The CUDA ordinal this process uses on its host.
    pub local_gpu: usize,
    /// Rank 0's host and the rendezvous port (the same on every rank).
    pub rendezvous: HostPort,
    /// The job's shared secret (at least [`MIN_TOKEN_CHARS`] characters).
    pub token: String,
    /// Which variables gave the rank, or the name of the explicit rank
    /// ([`OverrideNames::rank`]), for messages.
    pub source: &'static str,
}

/// The token is a secret: debug output shows its length only.
impl fmt::Debug for Launch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Launch")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_gpu", &self.local_gpu)
            .field("rendezvous", &self.rendezvous)
            .field(
                "token",
                &format_args!("<{} chars>", self.token.chars().count()),
            )
            .field("source", &self.source)
            .finish()
    }
}

/// What messages call each explicit value. A front end spells its own
/// options (the command line passes its flags, `--process-rank` and so
/// on); the default is neutral words that read in every message ("set
/// WORLD_SIZE or pass an explicit world size").
///
/// A name shown with a bad value is written `NAME="value"` when it is one
/// word (a flag, a keyword), `words "value"` otherwise
/// ([`LaunchError::Invalid`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverrideNames {
    /// Also [`Launch::source`] when the rank is given.
    pub rank: &'static str,
    pub world_size: &'static str,
    pub local_gpu: &'static str,
    pub rendezvous: &'static str,
}

impl Default for OverrideNames {
    fn default() -> OverrideNames {
        OverrideNames {
            rank: "an explicit rank",
            world_size: "an explicit world size",
            local_gpu: "an explicit local GPU",
            rendezvous: "an explicit rendezvous address",
        }
    }
}

/// Explicit values (e.g. from the command line's flags) that win over the
/// environment, and what messages call them.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct LaunchOverrides {
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    pub local_gpu: Option<usize>,
    /// `host:port` or `[ipv6]:port`.
    pub rendezvous: Option<String>,
    pub token: Option<String>,
    /// How messages name the values above (the token is "the job token
    /// given by the caller" and never shown).
    pub names: OverrideNames,
}

impl fmt::Debug for LaunchOverrides {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaunchOverrides")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_gpu", &self.local_gpu)
            .field("rendezvous", &self.rendezvous)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("names", &self.names)
            .finish()
    }
}

impl Launch {
    /// Reads the process environment (see the module doc).
    pub fn from_env() -> Result<Launch> {
        Launch::from_env_with(&LaunchOverrides::default())
    }

    /// Reads the process environment, `overrides` on top.
    pub fn from_env_with(overrides: &LaunchOverrides) -> Result<Launch> {
        // A value that is not UTF-8 keeps its replacement characters and
        // fails parsing with the variable named, instead of looking unset.
        Launch::from_lookup_with(
            |name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()),
            overrides,
        )
    }

    /// As [`Launch::from_env`], with `lookup(name)` standing for the
    /// environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Launch> {
        Launch::from_lookup_with(lookup, &LaunchOverrides::default())
    }

    /// As [`Launch::from_env_with`], with `lookup(name)` standing for the
    /// environment.
    pub fn from_lookup_with(
        lookup: impl Fn(&str) -> Option<String>,
        overrides: &LaunchOverrides,
    ) -> Result<Launch> {
        let env_number = |var: &'static str| -> Result<Option<usize>> {
            lookup(var).map(|v| number(var, &v)).transpose()
        };
        let names = &overrides.names;
        let family = FAMILIES.iter().find(|f| lookup(f.rank).is_some());

        let (rank, rank_var, source) = match (overrides.rank, family) {
            (Some(rank), _) => (rank, names.rank, names.rank),
            (None, Some(f)) => (env_number(f.rank)?.unwrap_or_default(), f.rank, f.source),
            (None, None) => return Err(LaunchError::Missing(no_rank(&lookup, names.rank))),
        };

        let (world_size, world_var) = match overrides.world_size {
            Some(n) => (n, names.world_size),
            None => {
                let ours = env_number(KRUSKAL.size)?;
                let theirs = match family {
                    Some(f) if f.size != KRUSKAL.size => env_number(f.size)?.map(|n| (n, f.size)),
                    _ => None,
                };
                match (theirs, ours) {
                    (Some((n, var)), Some(k)) if n != k => {
                        return Err(LaunchError::Inconsistent(format!(
                            "{}={k} disagrees with {var}={n}; unset one of them",
                            KRUSKAL.size
                        )));
                    }
                    (Some(found), _) => found,
                    (None, Some(k)) => (k, KRUSKAL.size),
                    (None, None) => {
                        let var = family.map_or(KRUSKAL.size, |f| f.size);
                        return Err(LaunchError::Missing(format!(
                            "the world size is not set: {rank_var} is set but {var} is not; \
                             set {var} or pass {}",
                            names.world_size
                        )));
                    }
                }
            }
        };
        if world_size == 0 {
            return Err(LaunchError::Invalid {
                var: world_var,
                value: "0".into(),
                problem: "the world size must be at least 1".into(),
            });
        }
        if rank >= world_size {
            return Err(LaunchError::Inconsistent(format!(
                "rank {rank} ({rank_var}) is not below the world size {world_size} \
                 ({world_var}); ranks run from 0 to {}",
                world_size - 1
            )));
        }

        let local_gpu = match overrides.local_gpu {
            Some(gpu) => gpu,
            None => match env_number(KRUSKAL.local)? {
                Some(gpu) => gpu,
                None => {
                    let theirs = match family {
                        Some(f) if f.local != KRUSKAL.local => env_number(f.local)?,
                        _ => None,
                    };
                    let var = family.map_or(KRUSKAL.local, |f| f.local);
                    theirs.ok_or_else(|| {
                        let or_theirs = if var == KRUSKAL.local {
                            String::new()
                        } else {
                            format!(" (or {var})")
                        };
                        LaunchError::Missing(format!(
                            "the local GPU is not set: set {}{or_theirs} or pass {}",
                            KRUSKAL.local, names.local_gpu
                        ))
                    })?
                }
            },
        };

        let rendezvous = match &overrides.rendezvous {
            Some(text) => HostPort::parse(names.rendezvous, text)?,
            None => rendezvous_from_env(&lookup, names.rendezvous)?,
        };

        let (token, from) = match &overrides.token {
            Some(token) => (token.clone(), "the job token given by the caller"),
            None => (
                lookup(TOKEN_VAR).ok_or_else(|| {
                    LaunchError::Token(format!("{TOKEN_VAR} is not set; {TOKEN_HOWTO}"))
                })?,
                TOKEN_VAR,
            ),
        };
        check_token(&token, from)?;

        Ok(Launch {
            rank,
            world_size,
            local_gpu,
            rendezvous,
            token,
            source,
        })
    }
}

/// The fewest distinct characters a job token may have. Sixteen spaces,
/// or one letter repeated, are as good as no secret; sixteen random hex
/// digits have fewer than this once in about 100,000 draws.
pub const MIN_TOKEN_DISTINCT: usize = 6;

/// Refuses a token shorter than [`MIN_TOKEN_CHARS`] or of fewer than
/// [`MIN_TOKEN_DISTINCT`] distinct characters (whitespace not counted);
/// `from` says where it came from. The token's value is never shown.
pub(crate) fn check_token(token: &str, from: &str) -> Result<()> {
    let chars = token.chars().count();
    if chars < MIN_TOKEN_CHARS {
        return Err(LaunchError::Token(format!(
            "{from} has {chars} characters, at least {MIN_TOKEN_CHARS} are needed; \
             {TOKEN_HOWTO}"
        )));
    }
    let mut distinct: Vec<char> = token.chars().filter(|c| !c.is_whitespace()).collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < MIN_TOKEN_DISTINCT {
        return Err(LaunchError::Token(format!(
            "{from} has only {} distinct characters besides whitespace, at least \
             {MIN_TOKEN_DISTINCT} are needed: it is too easy to guess; {TOKEN_HOWTO}",
            distinct.len()
        )));
    }
    Ok(())
}

/// The message when no family gives a rank; `explicit` names the
/// explicit rank.
fn no_rank(lookup: &impl Fn(&str) -> Option<String>, explicit: &str) -> String {
    let what = format!(
        "set KRUSKAL_RANK, KRUSKAL_WORLD_SIZE, KRUSKAL_LOCAL_GPU and KRUSKAL_RENDEZVOUS (or \
         start the ranks with torchrun, mpirun or srun), or pass {explicit}"
    );
    let stray = [KRUSKAL.size, KRUSKAL.local]
        .into_iter()
        .find(|var| lookup(var).is_some());
    match stray {
        Some(var) => format!("{var} is set but KRUSKAL_RANK is not: {what}"),
        None => format!("this process's rank is not set: {what}"),
    }
}

/// The rendezvous address from the variables; `explicit` names the
/// explicit address, for the message when none is set.
fn rendezvous_from_env(
    lookup: &impl Fn(&str) -> Option<String>,
    explicit: &str,
) -> Result<HostPort> {
    const VAR: &str = "KRUSKAL_RENDEZVOUS";
    if let Some(text) = lookup(VAR) {
        return HostPort::parse(VAR, &text);
    }
    match (lookup("MASTER_ADDR"), lookup("MASTER_PORT")) {
        (Some(host), Some(port)) => {
            let host = host
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .unwrap_or(&host);
            check_host(host).map_err(|problem| LaunchError::Invalid {
                var: "MASTER_ADDR",
                value: host.to_string(),
                problem: problem.into(),
            })?;
            let port = parse_port(&port).map_err(|problem| LaunchError::Invalid {
                var: "MASTER_PORT",
                value: port.clone(),
                problem: problem.into(),
            })?;
            Ok(HostPort {
                host: host.to_string(),
                port,
            })
        }
        (Some(_), None) => Err(LaunchError::Missing(
            "MASTER_ADDR is set but MASTER_PORT is not: set MASTER_PORT, or \
             KRUSKAL_RENDEZVOUS=host:port"
                .into(),
        )),
        (None, Some(_)) => Err(LaunchError::Missing(
            "MASTER_PORT is set but MASTER_ADDR is not: set MASTER_ADDR, or \
             KRUSKAL_RENDEZVOUS=host:port"
                .into(),
        )),
        (None, None) => Err(LaunchError::Missing(format!(
            "the rendezvous address is not set: set KRUSKAL_RENDEZVOUS=host:port (rank 0's \
             host and a free TCP port, the same on every rank), or MASTER_ADDR and \
             MASTER_PORT, or pass {explicit}"
        ))),
    }
}

/// A plain decimal number: digits only, no sign, no spaces, fits in u32.
fn number(var: &'static str, value: &str) -> Result<usize> {
    let problem = if value.is_empty() {
        "empty; expected a non-negative integer"
    } else if value.strip_prefix('-').is_some_and(all_digits) {
        "negative; expected a non-negative integer"
    } else if !all_digits(value) {
        "not a non-negative integer"
    } else {
        match value.parse::<u32>() {
            Ok(n) => return Ok(n as usize),
            Err(_) => "too large",
        }
    };
    Err(LaunchError::Invalid {
        var,
        value: value.to_string(),
        problem: problem.into(),
    })
}

fn all_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

fn parse_port(text: &str) -> std::result::Result<u16, &'static str> {
    if !all_digits(text) {
        return Err("the port is not a number in 1..=65535");
    }
    match text.parse::<u16>() {
        Ok(0) | Err(_) => Err("the port is not in 1..=65535"),
        Ok(port) => Ok(port),
    }
}

fn check_host(host: &str) -> std::result::Result<(), &'static str> {
    if host.is_empty() {
        Err("the host is missing")
    } else if host
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || "[]/@".contains(c))
    {
        Err("the host is not a host name or address")
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const TOKEN: &str = "0123456789abcdef";

    /// How the command line names the explicit values.
    const FLAGS: OverrideNames = OverrideNames {
        rank: "--process-rank",
        world_size: "--world-size",
        local_gpu: "--local-gpu",
        rendezvous: "--rendezvous",
    };

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    fn launch(pairs: &[(&str, &str)]) -> Result<Launch> {
        Launch::from_lookup(env(pairs))
    }

    fn message(pairs: &[(&str, &str)]) -> String {
        message_with(pairs, &LaunchOverrides::default())
    }

    fn message_with(pairs: &[(&str, &str)], overrides: &LaunchOverrides) -> String {
        match Launch::from_lookup_with(env(pairs), overrides) {
            Ok(l) => panic!("expected an error, got {l:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn kruskal_variables() {
        let l = launch(&[
            ("KRUSKAL_RANK", "2"),
            ("KRUSKAL_WORLD_SIZE", "4"),
            ("KRUSKAL_LOCAL_GPU", "1"),
            ("KRUSKAL_RENDEZVOUS", "node01:29500"),
            ("KRUSKAL_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_gpu), (2, 4, 1));
        assert_eq!(l.rendezvous.to_string(), "node01:29500");
        assert_eq!(l.token, TOKEN);
        assert_eq!(l.source, "KRUSKAL_* variables");
    }

    #[test]
    fn torchrun_variables() {
        let l = launch(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("KRUSKAL_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_gpu), (3, 8, 3));
        assert_eq!(
            l.rendezvous,
            HostPort {
                host: "10.0.0.1".into(),
                port: 29500
            }
        );
        assert!(l.source.starts_with("torchrun"));
    }

    #[test]
    fn openmpi_variables() {
        let l = launch(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "6"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("KRUSKAL_RENDEZVOUS", "head:4000"),
            ("KRUSKAL_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_gpu), (5, 6, 1));
        assert!(l.source.starts_with("OpenMPI"));
    }

    #[test]
    fn slurm_variables() {
        let l = launch(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("KRUSKAL_RENDEZVOUS", "[fe80::1]:29500"),
            ("KRUSKAL_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_gpu), (0, 2, 0));
        assert_eq!(l.rendezvous.host, "fe80::1");
        assert_eq!(l.rendezvous.to_string(), "[fe80::1]:29500");
        assert!(l.source.starts_with("Slurm"));
    }

    #[test]
    fn the_first_family_with_a_rank_wins() {
        // mpirun inside a Slurm allocation: both families are present.
        let l = launch(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("KRUSKAL_RENDEZVOUS", "head:4000"),
            ("KRUSKAL_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_gpu), (3, 4, 1));
        // kruskal's variables beat torchrun's.
        let l = launch(&[
            ("KRUSKAL_RANK", "1"),
            ("KRUSKAL_WORLD_SIZE", "2"),
            ("KRUSKAL_LOCAL_GPU", "0"),
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
            ("KRUSKAL_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert_eq!(l.rank, 1);
        assert_eq!(l.source, "KRUSKAL_* variables");
        // MASTER_* serves as the address when KRUSKAL_RENDEZVOUS is unset.
        assert_eq!(l.rendezvous.to_string(), "a:1");
    }

    #[test]
    fn kruskal_local_gpu_and_rendezvous_override_the_family() {
        let l = launch(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("KRUSKAL_LOCAL_GPU", "3"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
            ("KRUSKAL_RENDEZVOUS", "b:2"),
            ("KRUSKAL_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert_eq!(l.local_gpu, 3);
        assert_eq!(l.rendezvous.to_string(), "b:2");
        // An agreeing KRUSKAL_WORLD_SIZE is fine.
        let l = launch(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
            ("KRUSKAL_WORLD_SIZE", "2"),
            ("KRUSKAL_RENDEZVOUS", "b:2"),
            ("KRUSKAL_JOB_TOKEN", TOKEN),
        ])
        .unwrap();
        assert_eq!(l.world_size, 2);
    }

    #[test]
    fn overrides_win_over_the_environment() {
        let overrides = LaunchOverrides {
            rank: Some(1),
            world_size: Some(3),
            local_gpu: Some(2),
            rendezvous: Some("[::1]:7000".into()),
            token: Some("from-the-overrides".into()),
            names: FLAGS,
        };
        let l = Launch::from_lookup_with(
            env(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "9"),
                ("LOCAL_RANK", "0"),
                ("MASTER_ADDR", "a"),
                ("MASTER_PORT", "1"),
                ("KRUSKAL_JOB_TOKEN", TOKEN),
            ]),
            &overrides,
        )
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_gpu), (1, 3, 2));
        assert_eq!(l.rendezvous.to_string(), "[::1]:7000");
        assert_eq!(l.token, "from-the-overrides");
        assert_eq!(l.source, "--process-rank");
        // Flags alone are enough.
        let l = Launch::from_lookup_with(env(&[]), &overrides).unwrap();
        assert_eq!((l.rank, l.world_size, l.local_gpu), (1, 3, 2));
        // A flag fills what the environment lacks.
        let l = Launch::from_lookup_with(
            env(&[
                ("KRUSKAL_RANK", "1"),
                ("KRUSKAL_WORLD_SIZE", "2"),
                ("KRUSKAL_JOB_TOKEN", TOKEN),
            ]),
            &LaunchOverrides {
                local_gpu: Some(0),
                rendezvous: Some("h:5".into()),
                ..LaunchOverrides::default()
            },
        )
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_gpu), (1, 2, 0));
        // An override is checked like a variable.
        let e = Launch::from_lookup_with(
            env(&[("KRUSKAL_JOB_TOKEN", TOKEN)]),
            &LaunchOverrides {
                rank: Some(3),
                world_size: Some(3),
                local_gpu: Some(0),
                rendezvous: Some("h:5".into()),
                token: None,
                names: FLAGS,
            },
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank 3 (--process-rank) is not below the world size 3 (--world-size); ranks run from 0 to 2"
        );
        let e = Launch::from_lookup_with(
            env(&[]),
            &LaunchOverrides {
                rendezvous: Some("h".into()),
                ..overrides.clone()
            },
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("--rendezvous=\"h\": expected host:port")
        );
        let e = Launch::from_lookup_with(
            env(&[]),
            &LaunchOverrides {
                world_size: Some(0),
                ..overrides.clone()
            },
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "--world-size=\"0\": the world size must be at least 1"
        );
    }

    /// The command line's flags, where it passes them, name what is
    /// missing or wrong.
    #[test]
    fn messages_use_the_callers_names() {
        let flags = LaunchOverrides {
            names: FLAGS,
            ..LaunchOverrides::default()
        };
        assert_eq!(
            message_with(&[], &flags),
            "this process's rank is not set: set KRUSKAL_RANK, KRUSKAL_WORLD_SIZE, \
             KRUSKAL_LOCAL_GPU and KRUSKAL_RENDEZVOUS (or start the ranks with torchrun, \
             mpirun or srun), or pass --process-rank"
        );
        assert_eq!(
            message_with(&[("RANK", "0"), ("LOCAL_RANK", "0")], &flags),
            "the world size is not set: RANK is set but WORLD_SIZE is not; \
             set WORLD_SIZE or pass --world-size"
        );
        assert_eq!(
            message_with(
                &[],
                &LaunchOverrides {
                    rank: Some(0),
                    ..flags.clone()
                }
            ),
            "the world size is not set: --process-rank is set but KRUSKAL_WORLD_SIZE is not; \
             set KRUSKAL_WORLD_SIZE or pass --world-size"
        );
        assert_eq!(
            message_with(
                &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")],
                &flags
            ),
            "the local GPU is not set: set KRUSKAL_LOCAL_GPU (or OMPI_COMM_WORLD_LOCAL_RANK) \
             or pass --local-gpu"
        );
        assert_eq!(
            message_with(
                &[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")],
                &flags
            ),
            "the rendezvous address is not set: set KRUSKAL_RENDEZVOUS=host:port (rank 0's \
             host and a free TCP port, the same on every rank), or MASTER_ADDR and \
             MASTER_PORT, or pass --rendezvous"
        );
    }

    /// Without names from the caller, messages name no command line's flag
    /// and still read as sentences.
    #[test]
    fn default_names_are_neutral_words() {
        let given = LaunchOverrides {
            rank: Some(3),
            world_size: Some(3),
            local_gpu: Some(0),
            rendezvous: Some("h:5".into()),
            ..LaunchOverrides::default()
        };
        let messages = [
            message(&[]),
            message(&[("KRUSKAL_LOCAL_GPU", "0")]),
            message(&[("RANK", "0"), ("LOCAL_RANK", "0")]),
            message_with(
                &[],
                &LaunchOverrides {
                    rank: Some(0),
                    ..LaunchOverrides::default()
                },
            ),
            message(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]),
            message(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")]),
            message_with(&[("KRUSKAL_JOB_TOKEN", TOKEN)], &given),
            message_with(
                &[],
                &LaunchOverrides {
                    world_size: Some(0),
                    ..given.clone()
                },
            ),
            message_with(
                &[],
                &LaunchOverrides {
                    rank: Some(0),
                    rendezvous: Some("h".into()),
                    ..given.clone()
                },
            ),
        ];
        for m in &messages {
            let flag = m
                .as_bytes()
                .windows(3)
                .any(|w| w[0] == b'-' && w[1] == b'-' && w[2].is_ascii_alphabetic());
            assert!(!flag, "{m}");
        }
        assert_eq!(
            messages[0],
            "this process's rank is not set: set KRUSKAL_RANK, KRUSKAL_WORLD_SIZE, \
             KRUSKAL_LOCAL_GPU and KRUSKAL_RENDEZVOUS (or start the ranks with torchrun, \
             mpirun or srun), or pass an explicit rank"
        );
        assert_eq!(
            messages[1],
            "KRUSKAL_LOCAL_GPU is set but KRUSKAL_RANK is not: set KRUSKAL_RANK, \
             KRUSKAL_WORLD_SIZE, KRUSKAL_LOCAL_GPU and KRUSKAL_RENDEZVOUS (or start the ranks \
             with torchrun, mpirun or srun), or pass an explicit rank"
        );
        assert_eq!(
            messages[2],
            "the world size is not set: RANK is set but WORLD_SIZE is not; \
             set WORLD_SIZE or pass an explicit world size"
        );
        assert_eq!(
            messages[3],
            "the world size is not set: an explicit rank is set but KRUSKAL_WORLD_SIZE is \
             not; set KRUSKAL_WORLD_SIZE or pass an explicit world size"
        );
        assert_eq!(
            messages[4],
            "the local GPU is not set: set KRUSKAL_LOCAL_GPU (or OMPI_COMM_WORLD_LOCAL_RANK) \
             or pass an explicit local GPU"
        );
        assert!(
            messages[5].ends_with(
                "or MASTER_ADDR and MASTER_PORT, or pass an explicit rendezvous address"
            ),
            "{}",
            messages[5]
        );
        assert_eq!(
            messages[6],
            "rank 3 (an explicit rank) is not below the world size 3 (an explicit world \
             size); ranks run from 0 to 2"
        );
        assert_eq!(
            messages[7],
            "an explicit world size \"0\": the world size must be at least 1"
        );
        assert_eq!(
            messages[8],
            "an explicit rendezvous address \"h\": expected host:port, e.g. node01:29500"
        );
        // The explicit rank's name is where the rank came from.
        let l = Launch::from_lookup_with(
            env(&[("KRUSKAL_JOB_TOKEN", TOKEN)]),
            &LaunchOverrides {
                rank: Some(0),
                ..given
            },
        )
        .unwrap();
        assert_eq!(l.source, "an explicit rank");
    }

    #[test]
    fn the_token_is_required_and_never_shown() {
        let base = [
            ("KRUSKAL_RANK", "0"),
            ("KRUSKAL_WORLD_SIZE", "1"),
            ("KRUSKAL_LOCAL_GPU", "0"),
            ("KRUSKAL_RENDEZVOUS", "h:1"),
        ];
        let e = message(&base);
        assert!(e.starts_with("KRUSKAL_JOB_TOKEN is not set"), "{e}");
        assert!(
            e.contains("export KRUSKAL_JOB_TOKEN=$(openssl rand -hex 16)"),
            "{e}"
        );
        let mut short = base.to_vec();
        short.push(("KRUSKAL_JOB_TOKEN", "s3cret"));
        let e = message(&short);
        assert!(
            e.starts_with("KRUSKAL_JOB_TOKEN has 6 characters, at least 16 are needed; "),
            "{e}"
        );
        assert!(!e.contains("s3cret"), "{e}");
        let mut good = base.to_vec();
        good.push(("KRUSKAL_JOB_TOKEN", TOKEN));
        let l = launch(&good).unwrap();
        assert!(!format!("{l:?}").contains(TOKEN));
    }

    #[test]
    fn a_token_needs_16_characters() {
        let with = |token: &'static str| {
            launch(&[
                ("KRUSKAL_RANK", "0"),
                ("KRUSKAL_WORLD_SIZE", "1"),
                ("KRUSKAL_LOCAL_GPU", "0"),
                ("KRUSKAL_RENDEZVOUS", "h:1"),
                ("KRUSKAL_JOB_TOKEN", token),
            ])
        };
        let e = with("0123456789abcde").unwrap_err().to_string();
        assert!(
            e.starts_with("KRUSKAL_JOB_TOKEN has 15 characters, at least 16 are needed; "),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        assert_eq!(with("0123456789abcdef").unwrap().token, "0123456789abcdef");
        // Long enough, but no secret: spaces, one letter, two.
        for weak in [" ".repeat(16), "a".repeat(16), "abababababababab".into()] {
            let e = message(&[
                ("KRUSKAL_RANK", "0"),
                ("KRUSKAL_WORLD_SIZE", "1"),
                ("KRUSKAL_LOCAL_GPU", "0"),
                ("KRUSKAL_RENDEZVOUS", "h:1"),
                ("KRUSKAL_JOB_TOKEN", &weak),
            ]);
            assert!(
                e.contains("distinct characters") && !e.contains(&weak[..4]),
                "{e}"
            );
        }
        // Characters, not bytes, are counted.
        assert!(with("ééééééééééééééé").is_err());
        // A token from the caller is held to the same minimum.
        let e = Launch::from_lookup_with(
            env(&[]),
            &LaunchOverrides {
                rank: Some(0),
                world_size: Some(1),
                local_gpu: Some(0),
                rendezvous: Some("h:1".into()),
                token: Some("short".into()),
                names: OverrideNames::default(),
            },
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("the job token given by the caller has 5 characters"),
            "{e}"
        );
    }

    #[test]
    fn numbers_are_parsed_strictly() {
        let with = |var: &'static str, value: &'static str| {
            let mut pairs = vec![
                ("KRUSKAL_RANK", "1"),
                ("KRUSKAL_WORLD_SIZE", "2"),
                ("KRUSKAL_LOCAL_GPU", "0"),
                ("KRUSKAL_RENDEZVOUS", "h:1"),
                ("KRUSKAL_JOB_TOKEN", TOKEN),
            ];
            pairs.retain(|(k, _)| *k != var);
            pairs.push((var, value));
            message(&pairs)
        };
        assert_eq!(
            with("KRUSKAL_RANK", "one"),
            "KRUSKAL_RANK=\"one\": not a non-negative integer"
        );
        assert_eq!(
            with("KRUSKAL_RANK", "-1"),
            "KRUSKAL_RANK=\"-1\": negative; expected a non-negative integer"
        );
        assert_eq!(
            with("KRUSKAL_RANK", ""),
            "KRUSKAL_RANK=\"\": empty; expected a non-negative integer"
        );
        assert_eq!(
            with("KRUSKAL_RANK", " 1"),
            "KRUSKAL_RANK=\" 1\": not a non-negative integer"
        );
        assert_eq!(
            with("KRUSKAL_WORLD_SIZE", "+2"),
            "KRUSKAL_WORLD_SIZE=\"+2\": not a non-negative integer"
        );
        assert_eq!(
            with("KRUSKAL_WORLD_SIZE", "99999999999"),
            "KRUSKAL_WORLD_SIZE=\"99999999999\": too large"
        );
        assert_eq!(
            with("KRUSKAL_WORLD_SIZE", "0"),
            "KRUSKAL_WORLD_SIZE=\"0\": the world size must be at least 1"
        );
        assert_eq!(
            with("KRUSKAL_RANK", "2"),
            "rank 2 (KRUSKAL_RANK) is not below the world size 2 (KRUSKAL_WORLD_SIZE); \
             ranks run from 0 to 1"
        );
        assert_eq!(
            with("KRUSKAL_LOCAL_GPU", "x"),
            "KRUSKAL_LOCAL_GPU=\"x\": not a non-negative integer"
        );
    }

    #[test]
    fn rendezvous_addresses_are_parsed_strictly() {
        let with = |pairs: &[(&'static str, &'static str)]| {
            let mut all = vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "1"),
                ("LOCAL_RANK", "0"),
                ("KRUSKAL_JOB_TOKEN", TOKEN),
            ];
            all.extend_from_slice(pairs);
            launch(&all)
        };
        let e = |pairs: &[(&'static str, &'static str)]| with(pairs).unwrap_err().to_string();
        assert_eq!(
            e(&[("KRUSKAL_RENDEZVOUS", "node01")]),
            "KRUSKAL_RENDEZVOUS=\"node01\": expected host:port, e.g. node01:29500"
        );
        assert_eq!(
            e(&[("KRUSKAL_RENDEZVOUS", ":29500")]),
            "KRUSKAL_RENDEZVOUS=\":29500\": the host is missing"
        );
        assert_eq!(
            e(&[("KRUSKAL_RENDEZVOUS", "node01:0")]),
            "KRUSKAL_RENDEZVOUS=\"node01:0\": the port is not in 1..=65535"
        );
        assert_eq!(
            e(&[("KRUSKAL_RENDEZVOUS", "node01:65536")]),
            "KRUSKAL_RENDEZVOUS=\"node01:65536\": the port is not in 1..=65535"
        );
        assert_eq!(
            e(&[("KRUSKAL_RENDEZVOUS", "node01:http")]),
            "KRUSKAL_RENDEZVOUS=\"node01:http\": the port is not a number in 1..=65535"
        );
        assert_eq!(
            e(&[("KRUSKAL_RENDEZVOUS", "::1:29500")]),
            "KRUSKAL_RENDEZVOUS=\"::1:29500\": an IPv6 address needs brackets: [address]:port"
        );
        assert_eq!(
            e(&[("KRUSKAL_RENDEZVOUS", "[::1]29500")]),
            "KRUSKAL_RENDEZVOUS=\"[::1]29500\": expected [address]:port"
        );
        assert_eq!(
            e(&[("MASTER_ADDR", "a b"), ("MASTER_PORT", "1")]),
            "MASTER_ADDR=\"a b\": the host is not a host name or address"
        );
        assert_eq!(
            e(&[("MASTER_ADDR", "a"), ("MASTER_PORT", "-5")]),
            "MASTER_PORT=\"-5\": the port is not a number in 1..=65535"
        );
        assert!(
            e(&[("MASTER_ADDR", "a")]).starts_with("MASTER_ADDR is set but MASTER_PORT is not")
        );
        assert!(
            e(&[("MASTER_PORT", "1")]).starts_with("MASTER_PORT is set but MASTER_ADDR is not")
        );
        let missing = e(&[]);
        assert!(
            missing.starts_with("the rendezvous address is not set"),
            "{missing}"
        );
        assert!(
            missing.contains("KRUSKAL_RENDEZVOUS=host:port"),
            "{missing}"
        );
        let l = with(&[("MASTER_ADDR", "::1"), ("MASTER_PORT", "29500")]).unwrap();
        assert_eq!(l.rendezvous.to_string(), "[::1]:29500");
    }

    #[test]
    fn missing_and_inconsistent_values_are_named() {
        let e = message(&[("KRUSKAL_JOB_TOKEN", TOKEN)]);
        assert!(
            e.starts_with("this process's rank is not set: set KRUSKAL_RANK"),
            "{e}"
        );
        let e = message(&[("KRUSKAL_WORLD_SIZE", "2")]);
        assert!(
            e.starts_with("KRUSKAL_WORLD_SIZE is set but KRUSKAL_RANK is not"),
            "{e}"
        );
        let e = message(&[("RANK", "0"), ("LOCAL_RANK", "0")]);
        assert!(
            e.starts_with("the world size is not set: RANK is set but WORLD_SIZE is not"),
            "{e}"
        );
        let e = message(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        assert!(
            e.starts_with(
                "the local GPU is not set: set KRUSKAL_LOCAL_GPU (or OMPI_COMM_WORLD_LOCAL_RANK)"
            ),
            "{e}"
        );
        let e = message(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("KRUSKAL_WORLD_SIZE", "2"),
        ]);
        assert_eq!(
            e,
            "KRUSKAL_WORLD_SIZE=2 disagrees with SLURM_NTASKS=4; unset one of them"
        );
        // The winning family's other values are parsed strictly too.
        let e = message(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "zero")]);
        assert_eq!(e, "LOCAL_RANK=\"zero\": not a non-negative integer");
    }
}

//! Who this process is in a data-parallel job, read from the launcher's environment: torchrun
//! (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) or SLURM's `srun`
//! (`SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`, the first host of `SLURM_STEP_NODELIST`).
//!
//! The rendezvous listens on `XDISTILL_DIST_PORT`, or `MASTER_PORT + 1` where that is unset:
//! torchrun's own store already holds `MASTER_PORT` on rank 0's host.

use std::fmt;

/// The launcher that set the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    Torchrun,
    Slurm,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "srun",
        })
    }
}

/// This process's place in the job, and where rank 0's rendezvous listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    pub launcher: Launcher,
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    /// Rank 0's host, as the launcher names it.
    pub master_addr: String,
    /// The port of this crate's rendezvous on `master_addr` (not torchrun's store).
    pub port: u16,
}

/// An environment that names a data-parallel job but does not describe one completely or
/// consistently. Each message names the variable at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    #[error("{launcher} environment incomplete: {var} is not set (set by {launcher}; with a hand-made environment set {all})")]
    Missing {
        launcher: Launcher,
        var: &'static str,
        all: &'static str,
    },
    #[error("{var}={value:?} is not a {what}")]
    Invalid {
        var: &'static str,
        value: String,
        what: &'static str,
    },
    #[error("{var}={rank} is out of range for a world of {world_size} ({size_var})")]
    RankOutOfRange {
        var: &'static str,
        rank: usize,
        size_var: &'static str,
        world_size: usize,
    },
    #[error("both torchrun's RANK and SLURM's SLURM_PROCID are set but disagree ({rank} vs {procid}); under srun + torchrun, let one of them launch the trainer")]
    Conflict { rank: usize, procid: usize },
}

const TORCHRUN_VARS: &str = "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT";
const SLURM_VARS: &str = "SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_STEP_NODELIST";
/// Overrides the rendezvous port (default `MASTER_PORT + 1`, or 29501 under SLURM without
/// `MASTER_PORT`).
pub const PORT_ENV: &str = "XDISTILL_DIST_PORT";
const DEFAULT_MASTER_PORT: u16 = 29500;

impl World {
    /// The job this process belongs to, from the process environment; `None` for a plain run
    /// (no launcher variables at all).
    pub fn from_env() -> Result<Option<World>, LaunchError> {
        World::from_vars(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// As [`World::from_env`], reading variables through `var` (tests pass a map).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<World>, LaunchError> {
        let torchrun = var("RANK").is_some() || var("WORLD_SIZE").is_some();
        let slurm = var("SLURM_PROCID").is_some() && var("SLURM_NTASKS").is_some();
        let world = if torchrun {
            let w = torchrun_world(&var)?;
            if let Some(procid) = var("SLURM_PROCID") {
                let procid = parse_usize("SLURM_PROCID", &procid)?;
                let ntasks = var("SLURM_NTASKS").map(|v| parse_usize("SLURM_NTASKS", &v));
                // `srun torchrun …` sets both; only the torchrun-spawned layout counts then,
                // unless SLURM describes the same world (one task per rank).
                if matches!(ntasks, Some(Ok(n)) if n == w.world_size) && procid != w.rank {
                    return Err(LaunchError::Conflict {
                        rank: w.rank,
                        procid,
                    });
                }
            }
            w
        } else if slurm {
            slurm_world(&var)?
        } else {
            return Ok(None);
        };
        Ok(Some(world))
    }

    /// `cuda:LOCAL_RANK`'s ordinal: one process per device on a node.
    pub fn device_ordinal(&self) -> usize {
        self.local_rank
    }

    pub fn is_main(&self) -> bool {
        self.rank == 0
    }
}

fn torchrun_world(var: &impl Fn(&str) -> Option<String>) -> Result<World, LaunchError> {
    let need = |name: &'static str| {
        var(name).ok_or(LaunchError::Missing {
            launcher: Launcher::Torchrun,
            var: name,
            all: TORCHRUN_VARS,
        })
    };
    let world_size = parse_usize("WORLD_SIZE", &need("WORLD_SIZE")?)?;
    let rank = parse_usize("RANK", &need("RANK")?)?;
    let local_rank = parse_usize("LOCAL_RANK", &need("LOCAL_RANK")?)?;
    let master_addr = need("MASTER_ADDR")?;
    let master_port = parse_port("MASTER_PORT", &need("MASTER_PORT")?)?;
    check_world(
        rank,
        "RANK",
        local_rank,
        "LOCAL_RANK",
        world_size,
        "WORLD_SIZE",
    )?;
    Ok(World {
        launcher: Launcher::Torchrun,
        rank,
        local_rank,
        world_size,
        master_addr,
        port: rendezvous_port(var, master_port)?,
    })
}

fn slurm_world(var: &impl Fn(&str) -> Option<String>) -> Result<World, LaunchError> {
    let need = |name: &'static str| {
        var(name).ok_or(LaunchError::Missing {
            launcher: Launcher::Slurm,
            var: name,
            all: SLURM_VARS,
        })
    };
    let world_size = parse_usize("SLURM_NTASKS", &need("SLURM_NTASKS")?)?;
    let rank = parse_usize("SLURM_PROCID", &need("SLURM_PROCID")?)?;
    let local_rank = parse_usize("SLURM_LOCALID", &need("SLURM_LOCALID")?)?;
    check_world(
        rank,
        "SLURM_PROCID",
        local_rank,
        "SLURM_LOCALID",
        world_size,
        "SLURM_NTASKS",
    )?;
    let master_addr = match var("MASTER_ADDR") {
        Some(a) => a,
        None => {
            let (name, list) = match var("SLURM_STEP_NODELIST") {
                Some(l) => ("SLURM_STEP_NODELIST", l),
                None => ("SLURM_JOB_NODELIST", need("SLURM_JOB_NODELIST")?),
            };
            first_host(&list).ok_or(LaunchError::Invalid {
                var: name,
                value: list.clone(),
                what: "SLURM node list (e.g. `node[01-04],gpu7`)",
            })?
        }
    };
    let master_port = match var("MASTER_PORT") {
        Some(p) => parse_port("MASTER_PORT", &p)?,
        None => DEFAULT_MASTER_PORT,
    };
    Ok(World {
        launcher: Launcher::Slurm,
        rank,
        local_rank,
        world_size,
        master_addr,
        port: rendezvous_port(var, master_port)?,
    })
}

fn check_world(
    rank: usize,
    rank_var: &'static str,
    local_rank: usize,
    local_var: &'static str,
    world_size: usize,
    size_var: &'static str,
) -> Result<(), LaunchError> {
    if world_size == 0 {
        return Err(LaunchError::Invalid {
            var: size_var,
            value: "0".into(),
            what: "world size of at least 1",
        });
    }
    for (var, r) in [(rank_var, rank), (local_var, local_rank)] {
        if r >= world_size {
            return Err(LaunchError::RankOutOfRange {
                var,
                rank: r,
                size_var,
                world_size,
            });
        }
    }
    Ok(())
}

fn rendezvous_port(
    var: &impl Fn(&str) -> Option<String>,
    master_port: u16,
) -> Result<u16, LaunchError> {
    match var(PORT_ENV) {
        Some(p) => parse_port(PORT_ENV, &p),
        None => master_port.checked_add(1).ok_or(LaunchError::Invalid {
            var: "MASTER_PORT",
            value: master_port.to_string(),
            what: "port below 65535 (the rendezvous uses MASTER_PORT + 1; set XDISTILL_DIST_PORT)",
        }),
    }
}

fn parse_usize(var: &'static str, v: &str) -> Result<usize, LaunchError> {
    v.trim().parse().map_err(|_| LaunchError::Invalid {
        var,
        value: v.to_string(),
        what: "non-negative integer",
    })
}

fn parse_port(var: &'static str, v: &str) -> Result<u16, LaunchError> {
    match v.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(LaunchError::Invalid {
            var,
            value: v.to_string(),
            what: "TCP port (1-65535)",
        }),
    }
}

/// The first host of a SLURM node list: `node[01-04,07],gpu3` → `node01`, `a,b` → `a`,
/// `rack1-[3-5]` → `rack1-3`.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    // The first top-level entry: up to the first comma outside brackets.
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let entry = &list[..end];
    let host = match entry.find('[') {
        None => entry.to_string(),
        Some(open) => {
            let close = entry[open..].find(']')? + open;
            let first = entry[open + 1..close].split(',').next()?;
            let lo = first.split('-').next()?;
            if lo.is_empty() || !lo.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            format!("{}{}{}", &entry[..open], lo, &entry[close + 1..])
        }
    };
    (!host.is_empty() && !host.contains(['[', ']'])).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn world(vars: &[(&str, &str)]) -> Result<Option<World>, LaunchError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_vars(|k| m.get(k).cloned())
    }

    const TORCHRUN: [(&str, &str); 5] = [
        ("RANK", "3"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "10.0.0.7"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn plain_run_is_no_world() {
        assert_eq!(world(&[]).unwrap(), None);
        // SLURM allocations without srun-per-rank (SLURM_PROCID alone) are not a world.
        assert_eq!(world(&[("SLURM_JOB_ID", "9")]).unwrap(), None);
    }

    #[test]
    fn torchrun_environment() {
        let w = world(&TORCHRUN).unwrap().unwrap();
        assert_eq!(
            w,
            World {
                launcher: Launcher::Torchrun,
                rank: 3,
                local_rank: 1,
                world_size: 4,
                master_addr: "10.0.0.7".into(),
                port: 29501,
            }
        );
        assert_eq!(w.device_ordinal(), 1);
        let mut v = TORCHRUN.to_vec();
        v.push((PORT_ENV, "40000"));
        assert_eq!(world(&v).unwrap().unwrap().port, 40000);
    }

    #[test]
    fn partial_torchrun_environment_names_the_variable() {
        for missing in [
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            let v: Vec<_> = TORCHRUN
                .iter()
                .copied()
                .filter(|(k, _)| *k != missing)
                .collect();
            let e = world(&v).unwrap_err();
            assert!(
                matches!(e, LaunchError::Missing { var, .. } if var == missing),
                "{missing}: {e}"
            );
            assert!(e.to_string().contains(missing), "{e}");
        }
    }

    #[test]
    fn inconsistent_values_are_refused() {
        let mut v = TORCHRUN.to_vec();
        v[0] = ("RANK", "4");
        let e = world(&v).unwrap_err();
        assert!(
            e.to_string().contains("RANK=4") && e.to_string().contains("WORLD_SIZE"),
            "{e}"
        );
        v[0] = ("RANK", "x");
        assert!(world(&v).unwrap_err().to_string().contains("RANK=\"x\""));
        let mut v = TORCHRUN.to_vec();
        v[2] = ("WORLD_SIZE", "0");
        assert!(world(&v).is_err());
        let mut v = TORCHRUN.to_vec();
        v[4] = ("MASTER_PORT", "65535");
        assert!(world(&v)
            .unwrap_err()
            .to_string()
            .contains("XDISTILL_DIST_PORT"));
        let mut v = TORCHRUN.to_vec();
        v.extend([("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")]);
        assert!(matches!(world(&v), Err(LaunchError::Conflict { .. })));
    }

    #[test]
    fn slurm_environment() {
        let w = world(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_STEP_NODELIST", "gpu[012-015,020],cpu1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (w.launcher, w.rank, w.local_rank, w.world_size),
            (Launcher::Slurm, 5, 1, 8)
        );
        assert_eq!((w.master_addr.as_str(), w.port), ("gpu012", 29501));
        let e = world(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS", "2"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("SLURM_JOB_NODELIST"), "{e}");
    }

    #[test]
    fn slurm_node_lists() {
        for (list, host) in [
            ("node01", Some("node01")),
            ("a,b", Some("a")),
            ("node[01-04,07],gpu3", Some("node01")),
            ("rack1-[3-5]", Some("rack1-3")),
            ("n[7]", Some("n7")),
            ("n[x-3]", None),
            ("n[01", None),
            ("", None),
        ] {
            assert_eq!(first_host(list).as_deref(), host, "{list}");
        }
    }
}

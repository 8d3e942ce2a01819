//! `tallyd`'s configuration: one TOML file per node, flags on top.
//!
//! An unknown key or a bad value refuses the start, with an error naming the key and the
//! file. Every limit has a value: nothing is unbounded by default, and no limit can be
//! switched off.

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tally_crdt::{NodeId, Rule, WINDOW_SECS_MAX};
use tally_gossip::Seed;

/// The most keys a node may be configured to hold: the gossip map's key ids are 32 bits,
/// and it holds peers' keys up to the cap, its own and its earlier lives' past it. Also
/// the most `check_id_sessions_max`.
const KEYS_MAX: usize = 1 << 30;

/// The longest path a Unix socket may have: `sun_path`'s 108 bytes less the closing NUL.
const UNIX_SOCKET_PATH_MAX: usize = 107;

/// The longest `gossip_interval_ms`: a round is also the heartbeat, so peers read a node
/// that much stale between rounds, and anti-entropy heals no faster.
const GOSSIP_INTERVAL_MS_MAX: u64 = 60_000;

/// The longest `dead_after_ms`: until then a member cut off still counts in every
/// location's share, and its stale counts keep checks isolated.
const DEAD_AFTER_MS_MAX: u64 = 3_600_000;

/// The highest `lane_rate_max_per_sec`: at a higher rate a lane may hold `u64::MAX` within
/// the skew a writer's clock is allowed ([`tally_crdt::LANE_RATE_SKEW_SECS`]), so the
/// check would hold no lane to anything (and at `u64::MAX` it is off).
const LANE_RATE_MAX_PER_SEC_MAX: u64 = u64::MAX / (tally_crdt::LANE_RATE_SKEW_SECS + 1);

/// The longest `region_timeout_ms`: a check waiting for the region holds a place in the
/// node's room for exact checks (`exact_room`), and the application waits as long.
const REGION_TIMEOUT_MS_MAX: u64 = 60_000;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config {file}: cannot read: {source}")]
    Read {
        /// The file.
        file: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The file is not valid TOML, has an unknown key, or a value of the wrong type.
    #[error("config {file}: {message}")]
    Parse {
        /// The file.
        file: PathBuf,
        /// The parser's message, which names the key and the line.
        message: String,
    },
    /// A key has a value out of its bounds.
    #[error("config {file}: {key}: {why}")]
    Value {
        /// The file (or `flags`).
        file: PathBuf,
        /// The key, as a TOML path: `rules[2].limit`.
        key: String,
        /// What was wrong.
        why: String,
    },
}

/// A node's configuration, as read from its TOML file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This node's id: must be the id in its certificate.
    pub node_id: u64,
    /// `edge` (default) or `region`.
    #[serde(default)]
    pub role: Role,
    /// The UDP address for QUIC from peers.
    pub listen_gossip: SocketAddr,
    /// The loopback TCP address applications connect to.
    pub listen_client: SocketAddr,
    /// A Unix socket applications may connect to instead.
    #[serde(default)]
    pub client_socket: Option<PathBuf>,
    /// The loopback HTTP address for `/metrics` and `/status`.
    pub listen_http: SocketAddr,
    /// Where the generation file and the lane log live. Without it, every start is a new
    /// generation and a crash loses what peers had not yet received.
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// The region node, for exact rules.
    #[serde(default)]
    pub region: Option<SeedConfig>,
    /// The nodes to contact first.
    #[serde(default)]
    pub seeds: Vec<SeedConfig>,
    /// Certificates.
    pub tls: TlsConfig,
    /// The most live keys the lane store holds; new keys past it are refused. The gossip's
    /// map takes peers' keys up to it too.
    #[serde(default = "defaults::keys_max")]
    pub keys_max: usize,
    /// On the region: the most application sessions (processes that name checks with a
    /// `CheckId`) whose check ids its ledger holds; a check under a new one past it is
    /// refused until windows end. [`Config::check_id_sessions_max`] if not given.
    pub check_id_sessions_max: Option<usize>,
    /// The most a lane from a peer may hold (its two totals together) per second its
    /// window has run: a lane past it is left out, and this node falls behind its origin
    /// until the window is old enough.
    #[serde(default = "defaults::lane_rate_max_per_sec")]
    pub lane_rate_max_per_sec: u64,
    /// The anti-entropy period.
    #[serde(default = "defaults::gossip_interval_ms")]
    pub gossip_interval_ms: u64,
    /// How long fresh lanes wait, batched, before they are pushed to every peer.
    #[serde(default = "defaults::push_interval_ms")]
    pub push_interval_ms: u64,
    /// Peers per anti-entropy round.
    #[serde(default = "defaults::fanout")]
    pub fanout: usize,
    /// The largest gossip frame, sent or received.
    #[serde(default = "defaults::frame_bytes_max")]
    pub frame_bytes_max: usize,
    /// How long a silent member stays suspected before it is declared dead.
    #[serde(default = "defaults::dead_after_ms")]
    pub dead_after_ms: u64,
    /// The most client connections served at once.
    #[serde(default = "defaults::client_connections_max")]
    pub client_connections_max: usize,
    /// The rules this node answers.
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
    /// Set by the `--new-ledger` flag, never by the file: this start of a region makes its
    /// ledger, and is refused where one already is. Without it a region's start needs the
    /// ledger an earlier start made.
    #[serde(skip)]
    pub new_ledger: bool,
}

/// What a node does besides gossip.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Serves applications.
    #[default]
    Edge,
    /// Holds the authoritative counts of exact rules; needs a `data_dir`.
    Region,
}

/// A peer: its node id and where to reach it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeedConfig {
    /// The peer's node id (as in its certificate).
    pub node: u64,
    /// Its QUIC address.
    pub addr: SocketAddr,
}

/// PEM files: the cluster CA, this node's certificate and its key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The cluster CA certificate.
    pub ca: PathBuf,
    /// This node's certificate, signed by the CA, naming `node-<id>.tally`.
    pub cert: PathBuf,
    /// This node's private key.
    pub key: PathBuf,
}

/// One rule, as configured.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    /// Its name, as clients give it.
    pub name: String,
    /// The most admitted per window.
    pub limit: u64,
    /// The window's length in seconds.
    pub window_secs: u32,
    /// How checks are answered.
    #[serde(default)]
    pub mode: RuleMode,
    /// Isolated mode's allowance per location beyond its share of the limit.
    #[serde(default)]
    pub slack: u64,
    /// A live peer staler than this puts the rule in isolated mode.
    #[serde(default = "defaults::stale_after_ms")]
    pub stale_after_ms: u64,
    /// The number of locations the limit is shared over in isolated mode; by default the
    /// members this node knows, itself included.
    #[serde(default)]
    pub locations: Option<u64>,
    /// Weight the previous window: `prev x (1 - elapsed/len) + current`.
    #[serde(default)]
    pub sliding: bool,
    /// What an exact rule answers when the region cannot.
    #[serde(default)]
    pub on_region_unavailable: OnRegionUnavailable,
    /// How long an exact check waits for the region.
    #[serde(default = "defaults::region_timeout_ms")]
    pub region_timeout_ms: u64,
}

impl RuleConfig {
    /// Whether checks of this rule may be decided approximately: an approximate rule, or
    /// an exact one that falls back to an approximate decision.
    pub fn decides_approximately(&self) -> bool {
        self.mode == RuleMode::Approximate
            || self.on_region_unavailable == OnRegionUnavailable::Approximate
    }
}

/// How a rule answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuleMode {
    /// Decided at the edge on the estimate.
    #[default]
    Approximate,
    /// Decided at the region on the authoritative count.
    Exact,
}

/// What an exact rule answers when the region cannot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnRegionUnavailable {
    /// A `RegionUnavailable` error.
    #[default]
    Error,
    /// Decide approximately, and say so in the decision's mode.
    Approximate,
    /// Allow.
    Allow,
    /// Deny.
    Deny,
}

mod defaults {
    pub fn keys_max() -> usize {
        1_000_000
    }
    pub fn lane_rate_max_per_sec() -> u64 {
        1_000_000_000
    }
    pub fn gossip_interval_ms() -> u64 {
        1_000
    }
    pub fn push_interval_ms() -> u64 {
        5
    }
    pub fn fanout() -> usize {
        3
    }
    pub fn frame_bytes_max() -> usize {
        64 * 1024
    }
    pub fn dead_after_ms() -> u64 {
        10_000
    }
    pub fn client_connections_max() -> usize {
        1_024
    }
    pub fn stale_after_ms() -> u64 {
        3_000
    }
    pub fn region_timeout_ms() -> u64 {
        200
    }
}

/// The default of `check_id_sessions_max`: some 150 MiB of a region's ledger at one check
/// per session.
const CHECK_ID_SESSIONS_MAX: usize = 262_144;

impl Config {
    /// The most application sessions whose check ids a region's ledger holds:
    /// `check_id_sessions_max`, 262,144 if not given.
    pub fn check_id_sessions_max(&self) -> usize {
        self.check_id_sessions_max.unwrap_or(CHECK_ID_SESSIONS_MAX)
    }

    /// Reads and checks `file`.
    pub fn load(file: &Path) -> Result<Config, ConfigError> {
        Config::load_with_flags(file, |_| false)
    }

    /// Reads `file`, lets `flags` override its values (returning whether it changed any),
    /// and checks the result: a file that only the flags complete (a region's `data_dir`
    /// given as a flag) is taken. Errors name `file`, or "`file` with flags" where the
    /// flags changed something.
    pub fn load_with_flags(
        file: &Path,
        flags: impl FnOnce(&mut Config) -> bool,
    ) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(file).map_err(|source| ConfigError::Read {
            file: file.to_owned(),
            source,
        })?;
        let mut config = Config::parse_unchecked(&text, file)?;
        let named = if flags(&mut config) {
            PathBuf::from(format!("{} with flags", file.display()))
        } else {
            file.to_owned()
        };
        config.check(&named)?;
        Ok(config)
    }

    /// Parses and checks `text`, naming `file` in errors.
    pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
        let config = Config::parse_unchecked(text, file)?;
        config.check(file)?;
        Ok(config)
    }

    /// Parses `text` and checks what only the text shows (keys, their types, and keys
    /// written where they do nothing), not the values' bounds.
    fn parse_unchecked(text: &str, file: &Path) -> Result<Config, ConfigError> {
        let parse_error = |err: toml::de::Error| ConfigError::Parse {
            file: file.to_owned(),
            message: err.to_string().trim_end().replace('\n', " "),
        };
        let config: Config = toml::from_str(text).map_err(parse_error)?;
        let table: toml::Table = toml::from_str(text).map_err(parse_error)?;
        config.check_exact_only_keys(&table, file)?;
        Ok(config)
    }

    /// Refuses a key only an exact rule reads, written on an approximate one: most likely
    /// a promise whose `mode = "exact"` was left out, which would then be decided
    /// approximately, at every edge on its own. And a key only an approximate decision
    /// reads (`slack`, `locations`), written on an exact rule that never decides
    /// approximately: most likely a fallback meant to be `approximate`.
    fn check_exact_only_keys(&self, table: &toml::Table, file: &Path) -> Result<(), ConfigError> {
        let written = table.get("rules").and_then(toml::Value::as_array);
        for (i, (rule, written)) in self
            .rules
            .iter()
            .zip(written.into_iter().flatten())
            .enumerate()
        {
            if rule.mode == RuleMode::Exact {
                if rule.decides_approximately() {
                    continue;
                }
                for key in ["slack", "locations"] {
                    if written.get(key).is_some() {
                        return Err(ConfigError::Value {
                            file: file.to_owned(),
                            key: format!("rules[{i}].{key}"),
                            why: format!(
                                "only an approximate decision reads it, and this exact rule \
                                 never makes one (on_region_unavailable = \"{}\"): set \
                                 on_region_unavailable = \"approximate\" if it should, or \
                                 remove the key",
                                format!("{:?}", rule.on_region_unavailable).to_lowercase()
                            ),
                        });
                    }
                }
                continue;
            }
            for key in ["region_timeout_ms", "on_region_unavailable"] {
                if written.get(key).is_some() {
                    return Err(ConfigError::Value {
                        file: file.to_owned(),
                        key: format!("rules[{i}].{key}"),
                        why: "only an exact rule asks the region, and this rule is \
                              approximate: add mode = \"exact\" if it is a promise, or remove \
                              the key"
                            .into(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Why a peer at `addr` could never be reached from `listen_gossip`, if it could not:
    /// quinn refuses to dial port 0, an unspecified address or the other IP family, and a
    /// node that dials itself fails the handshake. (A socket bound to loopback reaches this
    /// machine's own other addresses too, so a seed off loopback is not refused.) Dialed in
    /// vain, a seed would go unheard until it counted dead, and the node would decide
    /// alone, on the whole limit.
    fn dialable(&self, addr: SocketAddr) -> Result<(), String> {
        let own = self.listen_gossip;
        let why = if addr.port() == 0 {
            "port 0 is no port a node listens on"
        } else if addr.ip().is_unspecified() {
            "an unspecified address is none a node listens on: give the one it binds"
        } else if addr.is_ipv4() != own.is_ipv4() {
            "another IP family than listen_gossip's, whose socket cannot reach it"
        } else if addr == own {
            "this node's own listen_gossip"
        } else {
            return Ok(());
        };
        Err(format!("{addr}: {why}"))
    }

    /// Checks every value against its bounds; `file` names where they came from.
    pub fn check(&self, file: &Path) -> Result<(), ConfigError> {
        let bad = |key: String, why: String| ConfigError::Value {
            file: file.to_owned(),
            key,
            why,
        };
        if self.node_id == 0 {
            return Err(bad("node_id".into(), "must be at least 1".into()));
        }
        // Nothing on these ports asks who is calling: an application could count, check
        // and spend any quota, and anyone could read the node's state.
        for (key, addr) in [
            ("listen_client", self.listen_client),
            ("listen_http", self.listen_http),
        ] {
            if !addr.ip().is_loopback() {
                return Err(bad(
                    key.into(),
                    format!(
                        "{addr} is not a loopback address: this port has no authentication, \
                         so it serves only this machine (127.0.0.0/8 or ::1)"
                    ),
                ));
            }
        }
        // Peers dial the address this node binds, as its row tells them; a machine's
        // addresses are not one peers can dial.
        if self.listen_gossip.ip().is_unspecified() {
            return Err(bad(
                "listen_gossip".into(),
                format!(
                    "{} is no address peers can dial: the node tells them the address it \
                     binds, so give one of this machine's own",
                    self.listen_gossip
                ),
            ));
        }
        if self.listen_http == self.listen_client && self.listen_client.port() != 0 {
            return Err(bad(
                "listen_http".into(),
                format!("{} is listen_client's address too", self.listen_http),
            ));
        }
        if let Some(path) = &self.client_socket {
            if path.as_os_str().is_empty() {
                // Linux would bind an abstract socket of a name no client knows.
                return Err(bad(
                    "client_socket".into(),
                    "is empty: give a path, or leave the key out".into(),
                ));
            }
            // `sun_path` holds 108 bytes with the closing NUL.
            if path.as_os_str().len() > UNIX_SOCKET_PATH_MAX {
                return Err(bad(
                    "client_socket".into(),
                    format!(
                        "{} is {} bytes long: a Unix socket's path takes at most \
                         {UNIX_SOCKET_PATH_MAX}",
                        path.display(),
                        path.as_os_str().len()
                    ),
                ));
            }
        }
        for (name, value) in [
            ("keys_max", self.keys_max),
            ("check_id_sessions_max", self.check_id_sessions_max()),
        ] {
            positive(value as u64, name).map_err(|why| bad(name.into(), why))?;
            if value > KEYS_MAX {
                return Err(bad(name.into(), format!("{value} is over {KEYS_MAX}")));
            }
        }
        within(
            self.lane_rate_max_per_sec,
            LANE_RATE_MAX_PER_SEC_MAX,
            "lane_rate_max_per_sec",
        )
        .map_err(|why| bad("lane_rate_max_per_sec".into(), why))?;
        within(
            self.gossip_interval_ms,
            GOSSIP_INTERVAL_MS_MAX,
            "gossip_interval_ms",
        )
        .map_err(|why| bad("gossip_interval_ms".into(), why))?;
        positive(self.push_interval_ms, "push_interval_ms")
            .map_err(|why| bad("push_interval_ms".into(), why))?;
        if self.push_interval_ms >= self.gossip_interval_ms {
            return Err(bad(
                "push_interval_ms".into(),
                format!(
                    "{} must be below gossip_interval_ms ({}): each round's heartbeat stamps \
                     this node's state as of then, while its writes wait up to a push \
                     interval and a half before they are sent, so peers read its staleness \
                     that much low",
                    self.push_interval_ms, self.gossip_interval_ms
                ),
            ));
        }
        positive(self.fanout as u64, "fanout").map_err(|why| bad("fanout".into(), why))?;
        within(self.dead_after_ms, DEAD_AFTER_MS_MAX, "dead_after_ms")
            .map_err(|why| bad("dead_after_ms".into(), why))?;
        if self.dead_after_ms <= self.gossip_interval_ms {
            // Held by every approximate rule's `stale_after_ms` too, but a node with none
            // (a region, or an edge of exact rules) must hold it as well (found in review,
            // session 46).
            return Err(bad(
                "dead_after_ms".into(),
                format!(
                    "{} must be above gossip_interval_ms ({}): a member is heard once a round, \
                     and one suspected for less than a round would be declared dead before \
                     its next heartbeat could clear it",
                    self.dead_after_ms, self.gossip_interval_ms
                ),
            ));
        }
        positive(self.client_connections_max as u64, "client_connections_max")
            .map_err(|why| bad("client_connections_max".into(), why))?;
        if self.client_connections_max > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(bad(
                "client_connections_max".into(),
                format!(
                    "{} is over {}",
                    self.client_connections_max,
                    tokio::sync::Semaphore::MAX_PERMITS
                ),
            ));
        }
        let frame_min = tally_gossip::Config::FRAME_BYTES_MIN;
        let frame_max = tally_gossip::wire::FRAME_BYTES_LIMIT;
        if !(frame_min..=frame_max).contains(&self.frame_bytes_max) {
            return Err(bad(
                "frame_bytes_max".into(),
                format!(
                    "{} is outside {frame_min}..={frame_max}",
                    self.frame_bytes_max
                ),
            ));
        }
        for (i, seed) in self.seeds.iter().enumerate() {
            if seed.node == self.node_id {
                return Err(bad(
                    format!("seeds[{i}].node"),
                    format!("{} is this node's own id", seed.node),
                ));
            }
            if seed.node == 0 {
                return Err(bad(
                    format!("seeds[{i}].node"),
                    "must be at least 1: no certificate names node 0".into(),
                ));
            }
            // A node is dialed at its first seed's address: a second would never be.
            if let Some(first) = self.seeds[..i].iter().position(|s| s.node == seed.node) {
                return Err(bad(
                    format!("seeds[{i}].node"),
                    format!("node {} is seeds[{first}] already", seed.node),
                ));
            }
            let key = format!("seeds[{i}].addr");
            self.dialable(seed.addr)
                .map_err(|why| bad(key.clone(), why))?;
            if let Some(first) = self.seeds[..i].iter().position(|s| s.addr == seed.addr) {
                return Err(bad(
                    key,
                    format!(
                        "{} is seeds[{first}].addr too: two nodes cannot listen on one address",
                        seed.addr
                    ),
                ));
            }
        }
        if let Some(region) = &self.region {
            self.dialable(region.addr)
                .map_err(|why| bad("region.addr".into(), why))?;
        }
        let paths = [
            ("data_dir", self.data_dir.as_deref()),
            ("tls.ca", Some(self.tls.ca.as_path())),
            ("tls.cert", Some(self.tls.cert.as_path())),
            ("tls.key", Some(self.tls.key.as_path())),
        ];
        for (key, path) in paths {
            if path.is_some_and(|path| path.as_os_str().is_empty()) {
                return Err(bad(
                    key.into(),
                    "is empty: give a path (relative to the working directory, or absolute)".into(),
                ));
            }
        }
        if self.check_id_sessions_max.is_some() && self.role != Role::Region {
            return Err(bad(
                "check_id_sessions_max".into(),
                "only a region (role = \"region\") holds check ids' sessions".into(),
            ));
        }
        if self.new_ledger && self.role != Role::Region {
            return Err(bad(
                "--new-ledger".into(),
                "only a region (role = \"region\") holds a ledger to start new".into(),
            ));
        }
        if self.role == Role::Region && self.data_dir.is_none() {
            return Err(bad(
                "data_dir".into(),
                "a region node needs a data_dir for its durable log".into(),
            ));
        }
        if let Some(region) = &self.region {
            if self.role == Role::Region {
                return Err(bad(
                    "region".into(),
                    "a region node decides exact checks itself: `region` names the region \
                     for an edge"
                        .into(),
                ));
            }
            if region.node == self.node_id {
                return Err(bad(
                    "region.node".into(),
                    format!("{} is this node's own id", region.node),
                ));
            }
            if region.node == 0 {
                return Err(bad(
                    "region.node".into(),
                    "must be at least 1: no certificate names node 0".into(),
                ));
            }
            if let Some(seed) = self.seeds.iter().find(|seed| seed.node == region.node) {
                if seed.addr != region.addr {
                    return Err(bad(
                        "region.addr".into(),
                        format!(
                            "{} is not the address the seeds give node {} ({}): one of \
                             them is wrong",
                            region.addr, region.node, seed.addr
                        ),
                    ));
                }
            }
            let other = (self.seeds.iter().enumerate())
                .find(|(_, seed)| seed.addr == region.addr && seed.node != region.node);
            if let Some((i, seed)) = other {
                return Err(bad(
                    "region.addr".into(),
                    format!(
                        "{} is seeds[{i}].addr (node {}) too: two nodes cannot listen on one \
                         address",
                        region.addr, seed.node
                    ),
                ));
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let key = |field: &str| format!("rules[{i}].{field}");
            Rule::new(rule.name.as_str()).map_err(|err| bad(key("name"), err.to_string()))?;
            if !names.insert(rule.name.as_str()) {
                return Err(bad(
                    key("name"),
                    format!("{:?} is defined twice", rule.name),
                ));
            }
            positive(rule.limit, "limit").map_err(|why| bad(key("limit"), why))?;
            if !(1..=WINDOW_SECS_MAX).contains(&rule.window_secs) {
                return Err(bad(
                    key("window_secs"),
                    format!("{} is outside 1..={WINDOW_SECS_MAX}", rule.window_secs),
                ));
            }
            // Read only by approximate decisions.
            if rule.decides_approximately() && rule.stale_after_ms >= self.dead_after_ms {
                return Err(bad(
                    key("stale_after_ms"),
                    format!(
                        "{} must be below dead_after_ms ({}): a member cut off is declared \
                         dead after its suspicion and dead_after_ms, and a dead member no \
                         longer makes checks isolated, so the rule might never turn isolated",
                        rule.stale_after_ms, self.dead_after_ms
                    ),
                ));
            }
            if rule.decides_approximately() && rule.stale_after_ms <= self.gossip_interval_ms {
                return Err(bad(
                    key("stale_after_ms"),
                    format!(
                        "{} must be above gossip_interval_ms ({}): an idle member's \
                         staleness rises to about one round between its heartbeats, so the \
                         rule would turn isolated every round",
                        rule.stale_after_ms, self.gossip_interval_ms
                    ),
                ));
            }
            within(
                rule.region_timeout_ms,
                REGION_TIMEOUT_MS_MAX,
                "region_timeout_ms",
            )
            .map_err(|why| bad(key("region_timeout_ms"), why))?;
            if rule.locations == Some(0) {
                return Err(bad(key("locations"), "must be at least 1".into()));
            }
            if rule.slack > rule.limit {
                return Err(bad(
                    key("slack"),
                    format!(
                        "{} is over the rule's limit ({}): a location's allowance past its \
                         share is at most the limit",
                        rule.slack, rule.limit
                    ),
                ));
            }
            if rule.mode == RuleMode::Exact && rule.limit > self.lane_rate_max_per_sec {
                // The region counts its admissions in its own lanes, unchecked, from the
                // window's first second: peers would leave a lane past the rate out.
                return Err(bad(
                    key("limit"),
                    format!(
                        "an exact rule's limit ({}) must be at most lane_rate_max_per_sec \
                         ({}): peers would not take the region's count of it",
                        rule.limit, self.lane_rate_max_per_sec
                    ),
                ));
            }
            if rule.mode == RuleMode::Exact && rule.sliding {
                return Err(bad(
                    key("sliding"),
                    "an exact rule is decided at the region on its fixed window: `sliding` \
                     weights the previous window for approximate rules only"
                        .into(),
                ));
            }
            if rule.mode == RuleMode::Exact && self.role == Role::Edge && self.region.is_none() {
                return Err(bad(
                    key("mode"),
                    "an exact rule on an edge needs a `region` to forward to".into(),
                ));
            }
        }
        Ok(())
    }

    /// This node's id.
    pub fn node(&self) -> NodeId {
        NodeId(self.node_id)
    }

    /// The seeds, as the gossip takes them.
    pub fn gossip_seeds(&self) -> Vec<Seed> {
        self.seeds
            .iter()
            .map(|seed| Seed {
                node: NodeId(seed.node),
                addr: seed.addr.to_string(),
            })
            .collect()
    }

    /// The anti-entropy period.
    pub fn gossip_interval(&self) -> Duration {
        Duration::from_millis(self.gossip_interval_ms)
    }

    /// The push batching interval.
    pub fn push_interval(&self) -> Duration {
        Duration::from_millis(self.push_interval_ms)
    }
}

// Its tests use the lane store, which runs on loom's atomics under `tally_loom`.
#[cfg(all(test, not(tally_loom)))]
impl RuleConfig {
    /// A rule with the defaults a config file would give, for unit tests.
    pub(crate) fn for_test(name: &str, limit: u64, mode: RuleMode) -> RuleConfig {
        RuleConfig {
            name: name.into(),
            limit,
            window_secs: 3_600,
            mode,
            slack: 0,
            stale_after_ms: defaults::stale_after_ms(),
            locations: None,
            sliding: false,
            on_region_unavailable: OnRegionUnavailable::Error,
            region_timeout_ms: defaults::region_timeout_ms(),
        }
    }
}

fn positive(value: u64, name: &str) -> Result<(), String> {
    if value == 0 {
        Err(format!("{name} must be at least 1, got 0"))
    } else {
        Ok(())
    }
}

fn within(value: u64, max: u64, name: &str) -> Result<(), String> {
    positive(value, name)?;
    if value > max {
        return Err(format!("{name} must be at most {max}, got {value}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
node_id = 1
listen_gossip = "127.0.0.1:7001"
listen_client = "127.0.0.1:7101"
listen_http = "127.0.0.1:7201"
seeds = [{ node = 2, addr = "127.0.0.1:7002" }]
tls = { ca = "ca.pem", cert = "node-1.pem", key = "node-1.key" }

[[rules]]
name = "login"
limit = 100
window_secs = 60
"#;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("node-1.toml"))
    }

    #[test]
    fn a_good_config_parses_with_defaults() {
        let config = parse(GOOD).unwrap();
        assert_eq!(config.node(), NodeId(1));
        assert_eq!(config.rules[0].mode, RuleMode::Approximate);
        assert_eq!(config.keys_max, 1_000_000);
        assert_eq!(config.check_id_sessions_max(), 262_144);
        assert_eq!(config.gossip_seeds()[0].node, NodeId(2));
        let largest = GOOD.replace("node_id = 1", "node_id = 1\nframe_bytes_max = 524288");
        assert_eq!(parse(&largest).unwrap().frame_bytes_max, 512 * 1024);
    }

    #[test]
    fn an_unknown_key_is_refused_naming_the_key_and_the_file() {
        let err = parse(&format!("{GOOD}\nlimt = 3\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("node-1.toml"), "{err}");
        assert!(err.contains("limt"), "{err}");
    }

    /// BRIEF.md's bad input: an unknown key refuses the start naming it and the file,
    /// wherever it is: at the top, in a seed, in the TLS table, as in a rule.
    #[test]
    fn an_unknown_key_anywhere_in_the_file_is_refused_naming_the_key_and_the_file() {
        for (typo, key) in [
            (
                GOOD.replace("node_id = 1", "node_id = 1\nkeys_mx = 5"),
                "keys_mx",
            ),
            (
                GOOD.replace(
                    "addr = \"127.0.0.1:7002\" }",
                    "addr = \"127.0.0.1:7002\", nod = 3 }",
                ),
                "nod",
            ),
            (
                GOOD.replace(
                    "key = \"node-1.key\" }",
                    "key = \"node-1.key\", crt = \"x.pem\" }",
                ),
                "crt",
            ),
        ] {
            assert_ne!(typo, GOOD, "{key} was put in");
            let err = parse(&typo).unwrap_err().to_string();
            assert!(err.contains("node-1.toml"), "{err}");
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    #[test]
    fn an_exact_rule_on_an_edge_without_a_region_is_refused() {
        let exact = GOOD.replace("window_secs = 60", "window_secs = 60\nmode = \"exact\"");
        let err = parse(&exact).unwrap_err().to_string();
        assert!(
            err.contains("rules[0].mode") && err.contains("region"),
            "{err}"
        );
        let with_region = format!("region = {{ node = 9, addr = \"127.0.0.9:7001\" }}\n{exact}");
        assert!(parse(&with_region).is_ok());
        let sliding = with_region.replace("mode = \"exact\"", "mode = \"exact\"\nsliding = true");
        let err = parse(&sliding).unwrap_err().to_string();
        assert!(err.contains("rules[0].sliding"), "{err}");
        let slow = with_region.replace("node_id = 1", "node_id = 1\nlane_rate_max_per_sec = 99");
        let err = parse(&slow).unwrap_err().to_string();
        assert!(
            err.contains("rules[0].limit") && err.contains("lane_rate_max_per_sec"),
            "{err}"
        );
    }

    #[test]
    fn keys_only_an_approximate_decision_reads_are_refused_on_an_exact_rule_that_makes_none() {
        let exact = format!(
            "region = {{ node = 9, addr = \"127.0.0.9:7001\" }}\n{}",
            GOOD.replace("window_secs = 60", "window_secs = 60\nmode = \"exact\"")
        );
        for key in ["slack = 5", "locations = 3"] {
            let with = exact.replace("mode = \"exact\"", &format!("mode = \"exact\"\n{key}"));
            let err = parse(&with).unwrap_err().to_string();
            let name = key.split(' ').next().unwrap();
            assert!(
                err.contains(&format!("rules[0].{name}")) && err.contains("\"error\""),
                "{err}"
            );
            let falls_back = with.replace(
                "mode = \"exact\"",
                "mode = \"exact\"\non_region_unavailable = \"approximate\"",
            );
            assert!(
                parse(&falls_back).is_ok(),
                "{key} with an approximate fallback"
            );
        }
        // Nor is its stale_after_ms held to the gossip's bounds, which it never reads.
        let unread = exact.replace(
            "mode = \"exact\"",
            "mode = \"exact\"\nstale_after_ms = 20000",
        );
        assert!(parse(&unread).is_ok());
    }

    #[test]
    fn a_region_node_naming_a_region_is_refused() {
        let region = format!(
            "role = \"region\"\ndata_dir = \"/tmp/r\"\n\
             region = {{ node = 9, addr = \"127.0.0.9:7001\" }}\n{GOOD}"
        );
        let err = parse(&region).unwrap_err().to_string();
        assert!(
            err.contains("node-1.toml") && err.contains("region") && err.contains("itself"),
            "{err}"
        );
        let without = region.replace("region = { node = 9, addr = \"127.0.0.9:7001\" }\n", "");
        assert!(parse(&without).is_ok());
    }

    #[test]
    fn check_id_sessions_max_is_a_regions_and_within_bounds() {
        let region =
            |line: &str| format!("role = \"region\"\ndata_dir = \"/tmp/r\"\n{line}\n{GOOD}");
        let config = parse(&region("check_id_sessions_max = 1000")).unwrap();
        assert_eq!(config.check_id_sessions_max(), 1_000);
        for bad in [
            "check_id_sessions_max = 0",
            "check_id_sessions_max = 1073741825",
        ] {
            let err = parse(&region(bad)).unwrap_err().to_string();
            assert!(err.contains("check_id_sessions_max"), "{bad}: {err}");
        }
        let edge = format!("check_id_sessions_max = 1000\n{GOOD}");
        let err = parse(&edge).unwrap_err().to_string();
        assert!(
            err.contains("check_id_sessions_max") && err.contains("only a region"),
            "{err}"
        );
    }

    #[test]
    fn a_bad_value_is_refused_naming_the_key_and_the_file() {
        let err = parse(&GOOD.replace("limit = 100", "limit = 0"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("node-1.toml") && err.contains("rules[0].limit"),
            "{err}"
        );
        let zero_rate = GOOD.replace("node_id = 1", "node_id = 1\nlane_rate_max_per_sec = 0");
        let err = parse(&zero_rate).unwrap_err().to_string();
        assert!(err.contains("lane_rate_max_per_sec"), "{err}");
        let err = parse(&GOOD.replace("window_secs = 60", "window_secs = \"x\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("window_secs"), "{err}");
        let err = parse(&GOOD.replace("node = 2", "node = 1"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("seeds[0].node"), "{err}");
    }

    #[test]
    fn the_readmes_example_config_is_taken() {
        let readme = include_str!("../../README.md");
        let start = readme
            .find("```toml\n# node-1.toml")
            .expect("the example in README.md");
        let example = &readme[start + "```toml\n".len()..];
        let example = &example[..example.find("```").expect("the example's end")];
        let config = parse(example).unwrap_or_else(|err| panic!("README.md's example: {err}"));
        assert_eq!(config.node_id, 1);
        assert!(config.rules.iter().any(|rule| rule.mode == RuleMode::Exact));
    }

    #[test]
    fn addresses_no_peer_can_be_reached_at_are_refused_by_name() {
        let seed = |addr: &str| GOOD.replace("127.0.0.1:7002", addr);
        let cases = [
            (seed("127.0.0.1:0"), "seeds[0].addr", "port 0"),
            (seed("0.0.0.0:7002"), "seeds[0].addr", "unspecified"),
            (seed("[::1]:7002"), "seeds[0].addr", "IP family"),
            (seed("127.0.0.1:7001"), "seeds[0].addr", "own listen_gossip"),
            (
                GOOD.replace(
                    "seeds = [{ node = 2, addr = \"127.0.0.1:7002\" }]",
                    "seeds = [{ node = 2, addr = \"127.0.0.1:7002\" }, \
                     { node = 3, addr = \"127.0.0.1:7002\" }]",
                ),
                "seeds[1].addr",
                "seeds[0].addr too",
            ),
            (
                GOOD.replace(
                    "node_id = 1",
                    "node_id = 1\nregion = { node = 9, addr = \"127.0.0.9:0\" }",
                ),
                "region.addr",
                "port 0",
            ),
            (
                GOOD.replace(
                    "node_id = 1",
                    "node_id = 1\nregion = { node = 9, addr = \"127.0.0.1:7002\" }",
                ),
                "region.addr",
                "seeds[0].addr (node 2) too",
            ),
        ];
        for (text, key, why) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(
                err.contains("node-1.toml") && err.contains(key) && err.contains(why),
                "{key}: {err}"
            );
        }
        let lan = GOOD.replace("127.0.0.1:7001", "10.0.0.1:7001");
        let lan = lan.replace("127.0.0.1:7002", "10.0.0.2:7002");
        assert!(
            parse(&lan).is_ok(),
            "a LAN address dialed from a LAN address"
        );
    }

    #[test]
    fn values_that_would_break_the_node_later_are_refused_by_name() {
        let cases = [
            (GOOD.replace("node = 2", "node = 0"), "seeds[0].node"),
            (
                GOOD.replace(
                    "window_secs = 60",
                    "window_secs = 60\nstale_after_ms = 1000",
                ),
                "rules[0].stale_after_ms",
            ),
            (
                GOOD.replace("window_secs = 60", "window_secs = 60\nslack = 101"),
                "rules[0].slack",
            ),
            (
                GOOD.replace(
                    "node_id = 1",
                    "node_id = 1\nclient_connections_max = 18446744073709551615",
                ),
                "client_connections_max",
            ),
            (
                GOOD.replace(
                    "node_id = 1",
                    "node_id = 1\nregion = { node = 0, addr = \"127.0.0.1:7003\" }",
                ),
                "region.node",
            ),
            (
                GOOD.replace("127.0.0.1:7101", "0.0.0.0:7101"),
                "listen_client",
            ),
            (
                GOOD.replace("127.0.0.1:7001", "0.0.0.0:7001"),
                "listen_gossip",
            ),
            (
                GOOD.replace("node_id = 1", "node_id = 1\npush_interval_ms = 1000"),
                "push_interval_ms",
            ),
            (
                GOOD.replace(
                    "node_id = 1",
                    "node_id = 1\nlane_rate_max_per_sec = 18446744073709551615",
                ),
                "lane_rate_max_per_sec",
            ),
            (
                GOOD.replace("node_id = 1", "node_id = 1\ndata_dir = \"\""),
                "data_dir",
            ),
            (GOOD.replace("ca = \"ca.pem\"", "ca = \"\""), "tls.ca"),
            (
                GOOD.replace("key = \"node-1.key\"", "key = \"\""),
                "tls.key",
            ),
            (
                GOOD.replace("node_id = 1", "node_id = 1\nkeys_max = 4294967296"),
                "keys_max",
            ),
            // Past the largest frame every peer can decode (4 MiB was taken until session
            // 44, and peers refused its full frames).
            (
                GOOD.replace("node_id = 1", "node_id = 1\nframe_bytes_max = 524289"),
                "frame_bytes_max",
            ),
            (GOOD.replace("127.0.0.1:7001", "[::]:7001"), "listen_gossip"),
            (
                GOOD.replace("127.0.0.1:7201", "127.0.0.1:7101"),
                "listen_http",
            ),
            (
                GOOD.replace(
                    "node_id = 1",
                    &format!(
                        "node_id = 1\nclient_socket = \"/run/{}.sock\"",
                        "s".repeat(100)
                    ),
                ),
                "client_socket",
            ),
            (
                GOOD.replace(
                    "seeds = [{ node = 2, addr = \"127.0.0.1:7002\" }]",
                    "seeds = [{ node = 2, addr = \"127.0.0.1:7002\" }, \
                     { node = 3, addr = \"127.0.0.1:7003\" }, \
                     { node = 2, addr = \"127.0.0.9:7002\" }]",
                ),
                "seeds[2].node",
            ),
            (
                GOOD.replace(
                    "node_id = 1",
                    "node_id = 1\nregion = { node = 2, addr = \"127.0.0.9:7002\" }",
                ),
                "region.addr",
            ),
            (
                GOOD.replace("node_id = 1", "node_id = 1\ndead_after_ms = 3000"),
                "rules[0].stale_after_ms",
            ),
            (
                GOOD.replace(
                    "window_secs = 60",
                    "window_secs = 60\non_region_unavailable = \"deny\"",
                ),
                "rules[0].on_region_unavailable",
            ),
            (
                GOOD.replace(
                    "window_secs = 60",
                    "window_secs = 60\nmode = \"approximate\"\nregion_timeout_ms = 100",
                ),
                "rules[0].region_timeout_ms",
            ),
            (
                GOOD.replace("127.0.0.1:7201", "10.0.0.5:7201"),
                "listen_http",
            ),
            (
                GOOD.replace("node_id = 1", "node_id = 1\nclient_socket = \"\""),
                "client_socket",
            ),
            (
                GOOD.replace("node_id = 1", "node_id = 1\ngossip_interval_ms = 60001"),
                "gossip_interval_ms",
            ),
            (
                GOOD.replace("node_id = 1", "node_id = 1\ndead_after_ms = 3600001"),
                "dead_after_ms",
            ),
            (
                GOOD.replace(
                    "node_id = 1",
                    "node_id = 1\ngossip_interval_ms = 1000\ndead_after_ms = 1000",
                )
                .replace("window_secs = 60", "window_secs = 60\nmode = \"exact\"")
                .replace(
                    "node_id = 1",
                    "node_id = 1\nregion = { node = 2, addr = \"127.0.0.1:7002\" }",
                ),
                "dead_after_ms: 1000 must be above gossip_interval_ms",
            ),
            (
                GOOD.replace(
                    "window_secs = 60",
                    "window_secs = 60\nmode = \"exact\"\nregion_timeout_ms = 60001",
                ),
                "rules[0].region_timeout_ms",
            ),
        ];
        for (text, key) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(
                err.contains("node-1.toml") && err.contains(key),
                "{key}: {err}"
            );
        }
        let at_the_limit = GOOD.replace("window_secs = 60", "window_secs = 60\nslack = 100");
        assert!(parse(&at_the_limit).is_ok());
        let at_the_timing_caps = GOOD
            .replace(
                "node_id = 1",
                "node_id = 1\ngossip_interval_ms = 60000\ndead_after_ms = 3600000\n\
                 region = { node = 2, addr = \"127.0.0.1:7002\" }",
            )
            .replace(
                "window_secs = 60",
                "window_secs = 60\nmode = \"exact\"\nregion_timeout_ms = 60000\n\
                 stale_after_ms = 120000",
            );
        parse(&at_the_timing_caps).unwrap();
        let other_loopbacks = GOOD
            .replace("127.0.0.1:7101", "127.3.2.1:7101")
            .replace("127.0.0.1:7201", "[::1]:7201");
        assert!(parse(&other_loopbacks).is_ok());
    }
}

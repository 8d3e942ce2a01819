//! Machine checks of the Architecture Invariants in `ARCHITECTURE.md`.
//!
//! Every check is a function over parsed text (the manifests, `Cargo.lock`, the sources of
//! `crdt/src` and `gossip/src`, `ARCHITECTURE.md`) that returns the violations it found, one
//! sentence each. The `#[test]`s at the top run the checks on this workspace and expect
//! none. The `negative_controls` module at the bottom feeds every check a text that breaks
//! its invariant and expects the break to be reported, so no check here can pass by
//! checking nothing.
//!
//! What these tests never do: build anything, run cargo, or touch the network. They read
//! files under the workspace root and nothing else.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use toml::{Table, Value};

// ---------------------------------------------------------------------------------------
// The rules. Change them here and in ARCHITECTURE.md together.
// ---------------------------------------------------------------------------------------

/// The workspace crates each workspace crate may depend on, by any kind of dependency
/// (normal, dev, build; a dev-dependency cycle would bend the line just as well).
///
/// The line is `crdt <- gossip <- node`. `node` may also use `client`, whose wire types its
/// client listener speaks. The root package `tally` is the CLI and sits on top of all.
/// A workspace crate missing from this table is itself a violation: a new crate gets its
/// place in the map (ARCHITECTURE.md) before it gets code.
const ALLOWED_WORKSPACE_DEPS: &[(&str, &[&str])] = &[
    ("tally-crdt", &[]),
    ("tally-gossip", &["tally-crdt"]),
    (
        "tally-node",
        &["tally-crdt", "tally-gossip", "tally-client"],
    ),
    ("tally-client", &[]),
    (
        "tally",
        &["tally-crdt", "tally-gossip", "tally-node", "tally-client"],
    ),
];

/// The edges that make the line: each crate depends (normally) on the one below it.
const REQUIRED_EDGES: &[(&str, &str)] = &[
    ("tally-gossip", "tally-crdt"),
    ("tally-node", "tally-gossip"),
];

/// The crates that are pure state: no runtime, no network, no disk, no clock.
const PURE_CRATES: &[(&str, &str)] = &[("tally-crdt", "crdt"), ("tally-gossip", "gossip")];

/// Exact crate names that are an async runtime or a network stack.
const RUNTIME_OR_NETWORK_CRATES: &[&str] = &[
    "mio",
    "socket2",
    "async-std",
    "smol",
    "async-executor",
    "async-global-executor",
    "async-io",
    "futures-executor",
    "glommio",
    "monoio",
    "compio",
    "actix-rt",
    "embassy-executor",
];

/// Crate-name prefixes that are an async runtime or a network stack (`tokio-util`,
/// `quinn-proto`, `rustls-pemfile`, ...).
const RUNTIME_OR_NETWORK_PREFIXES: &[&str] = &["tokio", "quinn", "rustls"];

/// The one bincode the workspace may use: 3.0.0 on crates.io is a deliberate compile error.
const BINCODE_PIN: &str = "=2.0.1";

/// What the sources of the pure crates never mention, and why.
const FORBIDDEN_IN_PURE_SOURCES: &[Forbidden] = &[
    Forbidden {
        pattern: "std::net",
        why: "sockets belong to the node",
        sim_may_use: true,
    },
    Forbidden {
        pattern: "std::fs",
        why: "disk belongs to the node",
        sim_may_use: true,
    },
    Forbidden {
        pattern: "tokio",
        why: "no async runtime below the node",
        sim_may_use: false,
    },
    Forbidden {
        pattern: "quinn",
        why: "QUIC belongs to the node's driver",
        sim_may_use: false,
    },
    Forbidden {
        pattern: "Instant::now",
        why: "time is an input",
        sim_may_use: false,
    },
    Forbidden {
        pattern: "SystemTime::now",
        why: "time is an input",
        sim_may_use: false,
    },
    Forbidden {
        pattern: "thread_rng",
        why: "randomness is an input (seeded)",
        sim_may_use: false,
    },
    Forbidden {
        pattern: "rand::random",
        why: "randomness is an input (seeded)",
        sim_may_use: false,
    },
    Forbidden {
        pattern: "RandomState",
        why: "randomness is an input: a hasher is keyed by a seed passed in",
        sim_may_use: false,
    },
    Forbidden {
        pattern: "DefaultHashBuilder",
        why: "randomness is an input: a hasher is keyed by a seed passed in",
        sim_may_use: false,
    },
    Forbidden {
        pattern: "HashMap",
        why: "std's HashMap keys its hasher from the OS: randomness is an input",
        sim_may_use: false,
    },
    Forbidden {
        pattern: "HashSet",
        why: "std's HashSet keys its hasher from the OS: randomness is an input",
        sim_may_use: false,
    },
];

/// One thing the pure crates' sources never mention.
struct Forbidden {
    /// Matched on whole words in code, after comments and literals are blanked out.
    pattern: &'static str,
    why: &'static str,
    /// Whether gossip's feature-gated simulator module (`gossip/src/sim.rs` or
    /// `gossip/src/sim/`) may use it: addresses for simulated peers, a trace file for a
    /// failing seed. The simulator never reads the real clock or ambient randomness either.
    sim_may_use: bool,
}

// ---------------------------------------------------------------------------------------
// The checks on this workspace.
// ---------------------------------------------------------------------------------------

#[test]
fn crdt_depends_on_no_other_workspace_crate() {
    assert_none(check_workspace_deps_of(&workspace(), "tally-crdt"));
}

#[test]
fn gossip_depends_only_on_crdt_among_workspace_crates() {
    assert_none(check_workspace_deps_of(&workspace(), "tally-gossip"));
}

#[test]
fn client_depends_on_no_other_workspace_crate() {
    assert_none(check_workspace_deps_of(&workspace(), "tally-client"));
}

#[test]
fn node_depends_only_on_the_crates_below_it() {
    assert_none(check_workspace_deps_of(&workspace(), "tally-node"));
}

#[test]
fn dependency_graph_is_a_line_from_crdt_through_gossip_to_node() {
    assert_none(check_dependency_line(&workspace()));
}

#[test]
fn crdt_and_gossip_never_depend_on_an_async_runtime_or_network_stack() {
    assert_none(check_no_runtime_deps(&workspace()));
}

#[test]
fn crdt_and_gossip_never_pull_in_an_async_runtime_or_network_stack_transitively() {
    let lock = Lock::parse(&read("Cargo.lock"));
    assert_none(check_no_runtime_deps_transitively(&workspace(), &lock));
}

#[test]
fn crdt_and_gossip_sources_never_touch_sockets_disk_clocks_or_ambient_randomness() {
    let mut sources = Vec::new();
    for (_, dir) in PURE_CRATES {
        sources.extend(rust_files(&format!("{dir}/src")));
    }
    assert!(
        !sources.is_empty(),
        "found no sources under crdt/src or gossip/src"
    );
    assert_none(check_pure_sources(&sources));
}

#[test]
fn every_package_is_unpublished_through_the_workspace() {
    assert_none(check_unpublished(&workspace()));
}

#[test]
fn every_package_takes_its_lints_from_the_workspace() {
    assert_none(check_workspace_lints(&workspace()));
}

#[test]
fn rust_version_is_set_only_in_the_root_workspace_package() {
    let root_files: Vec<String> = std::fs::read_dir(root())
        .expect("the workspace root is readable")
        .map(|entry| {
            entry
                .expect("a directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_none(check_rust_version_in_one_place(&workspace(), &root_files));
}

#[test]
fn every_dependency_version_is_declared_once_in_the_workspace() {
    assert_none(check_dependencies_from_workspace(&workspace()));
}

#[test]
fn bincode_is_pinned_to_2_0_1_wherever_it_appears() {
    let lock = Lock::parse(&read("Cargo.lock"));
    assert_none(check_bincode_pinned(&workspace(), &lock));
}

/// TESTING.md S11 where the advisory database cannot be fetched: a crate, or a version of
/// one, enters Cargo.lock only with a change to the list of reviewed dependencies, when the
/// review by hand is due again.
#[test]
fn every_crate_from_the_registry_in_the_lock_is_in_the_dependency_review_list() {
    let lock = Lock::parse(&read("Cargo.lock"));
    assert_none(check_dependencies_reviewed(
        &lock,
        &read("docs/dependencies-reviewed.txt"),
    ));
}

#[test]
fn every_bincode_config_carries_a_decode_limit() {
    let ws = workspace();
    let mut violations = Vec::new();
    for package in ws.packages() {
        let sources = rust_files(&format!("{}/src", package.dir));
        violations.extend(check_bincode_limits(&sources));
        let uses_bincode = package
            .table
            .get("dependencies")
            .and_then(Value::as_table)
            .is_some_and(|deps| deps.contains_key("bincode"));
        if uses_bincode {
            violations.extend(check_bincode_config_found(package.name(), &sources));
        }
    }
    assert_none(violations);
}

#[test]
fn every_architecture_invariant_names_what_enforces_it() {
    let doc = read("ARCHITECTURE.md");
    assert_none(check_invariants_documented(
        &doc,
        include_str!("architecture.rs"),
    ));
}

// ---------------------------------------------------------------------------------------
// Manifests.
// ---------------------------------------------------------------------------------------

/// One package's manifest.
struct Manifest {
    /// The package's directory relative to the workspace root (`"."` for the root package).
    dir: String,
    table: Table,
}

impl Manifest {
    fn parse(dir: &str, text: &str) -> Manifest {
        let table = text
            .parse::<Table>()
            .unwrap_or_else(|e| panic!("{dir}/Cargo.toml does not parse: {e}"));
        Manifest {
            dir: dir.to_string(),
            table,
        }
    }

    fn name(&self) -> &str {
        self.package()
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("{}/Cargo.toml has no package.name", self.dir))
    }

    fn package(&self) -> &Table {
        self.table
            .get("package")
            .and_then(Value::as_table)
            .unwrap_or_else(|| panic!("{}/Cargo.toml has no [package]", self.dir))
    }

    fn path(&self) -> String {
        format!("{}/Cargo.toml", self.dir)
            .trim_start_matches("./")
            .to_string()
    }
}

/// The root manifest and every member's.
struct Workspace {
    root: Manifest,
    members: Vec<Manifest>,
}

impl Workspace {
    /// `members` are `(dir, Cargo.toml text)`.
    fn parse(root: &str, members: &[(&str, &str)]) -> Workspace {
        let root = Manifest::parse(".", root);
        let members = members
            .iter()
            .map(|(dir, text)| Manifest::parse(dir, text))
            .collect();
        Workspace { root, members }
    }

    fn member_dirs(root: &Manifest) -> Vec<String> {
        root.table
            .get("workspace")
            .and_then(|w| w.get("members"))
            .and_then(Value::as_array)
            .expect("the root Cargo.toml lists workspace.members")
            .iter()
            .map(|m| m.as_str().expect("a member is a path").to_string())
            .collect()
    }

    /// The root package (if the root manifest has one) and every member.
    fn packages(&self) -> impl Iterator<Item = &Manifest> {
        let root = self
            .root
            .table
            .contains_key("package")
            .then_some(&self.root);
        root.into_iter().chain(&self.members)
    }

    fn package(&self, name: &str) -> Option<&Manifest> {
        self.packages().find(|p| p.name() == name)
    }

    fn crate_names(&self) -> BTreeSet<String> {
        self.packages().map(|p| p.name().to_string()).collect()
    }

    fn workspace_table(&self, key: &str) -> Option<&Table> {
        self.root.table.get("workspace")?.get(key)?.as_table()
    }

    /// Every dependency `manifest` declares, of every kind, for every target.
    fn deps(&self, manifest: &Manifest) -> Vec<Dep> {
        // `(kind, Some(cfg) for a [target.'cfg'] table, the table)`.
        let mut scopes: Vec<(Option<String>, &Table)> = vec![(None, &manifest.table)];
        if let Some(targets) = manifest.table.get("target").and_then(Value::as_table) {
            for (cfg, scope) in targets {
                if let Some(scope) = scope.as_table() {
                    scopes.push((Some(cfg.clone()), scope));
                }
            }
        }
        let mut tables: Vec<(Kind, Option<String>, &Table)> = Vec::new();
        for (target, scope) in scopes {
            for (key, kind) in DEP_TABLES {
                if let Some(table) = scope.get(*key).and_then(Value::as_table) {
                    tables.push((*kind, target.clone(), table));
                }
            }
        }
        let inherited = self.workspace_table("dependencies");
        let mut deps = Vec::new();
        for (kind, target, table) in tables {
            for (key, spec) in table {
                let from_workspace = is_workspace_ref(spec);
                let renamed = |spec: &Value| {
                    spec.get("package")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                };
                let package = renamed(spec)
                    .or_else(|| {
                        from_workspace
                            .then(|| inherited?.get(key).and_then(renamed))
                            .flatten()
                    })
                    .unwrap_or_else(|| key.clone());
                deps.push(Dep {
                    key: key.clone(),
                    package,
                    kind,
                    target: target.clone(),
                    spec: spec.clone(),
                });
            }
        }
        deps
    }

    /// The package names `manifest` depends on with normal (non-dev, non-build) deps.
    fn normal_deps(&self, manifest: &Manifest) -> Vec<Dep> {
        self.deps(manifest)
            .into_iter()
            .filter(|d| d.kind == Kind::Normal)
            .collect()
    }
}

/// The dependency tables of a manifest, with the legacy underscore spellings.
const DEP_TABLES: &[(&str, Kind)] = &[
    ("dependencies", Kind::Normal),
    ("dev-dependencies", Kind::Dev),
    ("dev_dependencies", Kind::Dev),
    ("build-dependencies", Kind::Build),
    ("build_dependencies", Kind::Build),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Normal,
    Dev,
    Build,
}

impl Kind {
    fn table(self) -> &'static str {
        match self {
            Kind::Normal => "dependencies",
            Kind::Dev => "dev-dependencies",
            Kind::Build => "build-dependencies",
        }
    }
}

/// One declared dependency.
struct Dep {
    /// The name it is declared under.
    key: String,
    /// The package it names (differs from `key` when renamed with `package = "..."`).
    package: String,
    kind: Kind,
    /// `Some(cfg)` for `[target.'cfg'.dependencies]`.
    target: Option<String>,
    spec: Value,
}

impl Dep {
    /// Where it is declared, for messages: `[target.'cfg(x)'.dev-dependencies] foo`.
    fn place(&self) -> String {
        match &self.target {
            Some(cfg) => format!("[target.'{cfg}'.{}] {}", self.kind.table(), self.key),
            None => format!("[{}] {}", self.kind.table(), self.key),
        }
    }
}

fn is_workspace_ref(spec: &Value) -> bool {
    spec.get("workspace").and_then(Value::as_bool) == Some(true)
}

fn is_runtime_or_network(package: &str) -> bool {
    RUNTIME_OR_NETWORK_CRATES.contains(&package)
        || RUNTIME_OR_NETWORK_PREFIXES
            .iter()
            .any(|prefix| package == *prefix || package.starts_with(&format!("{prefix}-")))
}

// ---------------------------------------------------------------------------------------
// Checks over manifests. Each returns its violations; empty means the invariant holds.
// ---------------------------------------------------------------------------------------

/// `crate_name` depends only on the workspace crates `ALLOWED_WORKSPACE_DEPS` gives it.
fn check_workspace_deps_of(ws: &Workspace, crate_name: &str) -> Vec<String> {
    let Some(manifest) = ws.package(crate_name) else {
        return vec![format!("no workspace package is named {crate_name}")];
    };
    let Some((_, allowed)) = ALLOWED_WORKSPACE_DEPS
        .iter()
        .find(|(name, _)| *name == crate_name)
    else {
        return vec![format!(
            "{crate_name} has no place in the dependency line: add it to ARCHITECTURE.md and to \
             ALLOWED_WORKSPACE_DEPS in tests/architecture.rs"
        )];
    };
    let workspace_crates = ws.crate_names();
    ws.deps(manifest)
        .into_iter()
        .filter(|dep| {
            workspace_crates.contains(&dep.package) && !allowed.contains(&dep.package.as_str())
        })
        .map(|dep| {
            format!(
                "{}: {} depends on workspace crate {} ({}); it may depend only on {:?}",
                manifest.path(),
                crate_name,
                dep.package,
                dep.place(),
                allowed
            )
        })
        .collect()
}

/// Every workspace crate has a place in the line, keeps to it, and the line's edges exist.
fn check_dependency_line(ws: &Workspace) -> Vec<String> {
    let mut violations = Vec::new();
    for name in ws.crate_names() {
        violations.extend(check_workspace_deps_of(ws, &name));
    }
    for (from, to) in REQUIRED_EDGES {
        let Some(manifest) = ws.package(from) else {
            violations.push(format!(
                "the line needs {from}, and no workspace package has that name"
            ));
            continue;
        };
        if !ws
            .normal_deps(manifest)
            .iter()
            .any(|dep| dep.package == *to)
        {
            violations.push(format!(
                "{}: {from} does not depend on {to}, so the graph is not the line crdt <- gossip <- node",
                manifest.path()
            ));
        }
    }
    violations
}

/// crdt and gossip declare no normal dependency on a runtime or network crate.
fn check_no_runtime_deps(ws: &Workspace) -> Vec<String> {
    let mut violations = Vec::new();
    for (name, _) in PURE_CRATES {
        let Some(manifest) = ws.package(name) else {
            violations.push(format!("no workspace package is named {name}"));
            continue;
        };
        for dep in ws.normal_deps(manifest) {
            if is_runtime_or_network(&dep.package) {
                violations.push(format!(
                    "{}: {name} depends on {} ({}): no async runtime or network stack below the node",
                    manifest.path(),
                    dep.package,
                    dep.place()
                ));
            }
        }
    }
    violations
}

/// Nothing crdt and gossip depend on normally, however deep, is a runtime or network crate.
///
/// Follows `Cargo.lock` from each direct normal dependency. The lock records, for a
/// registry package, every dependency some build in this workspace enables (never its
/// dev-dependencies), so this over-approximates: an optional dependency that another member
/// switches on counts too. That is the build that ships, so it is the right one to check.
fn check_no_runtime_deps_transitively(ws: &Workspace, lock: &Lock) -> Vec<String> {
    let workspace_crates = ws.crate_names();
    let mut violations = Vec::new();
    for (name, _) in PURE_CRATES {
        let Some(manifest) = ws.package(name) else {
            violations.push(format!("no workspace package is named {name}"));
            continue;
        };
        // `via[p]` is the package through which `p` was first reached, to print the chain.
        let mut via: BTreeMap<String, String> = BTreeMap::new();
        let mut stack: Vec<(String, Option<String>, String)> = Vec::new();
        let mut seen_members = BTreeSet::from([name.to_string()]);
        let push_member_deps =
            |member: &Manifest, stack: &mut Vec<(String, Option<String>, String)>| {
                for dep in ws.normal_deps(member) {
                    stack.push((dep.package, None, member.name().to_string()));
                }
            };
        push_member_deps(manifest, &mut stack);
        let mut seen = BTreeSet::new();
        while let Some((package, version, parent)) = stack.pop() {
            if workspace_crates.contains(&package) {
                if seen_members.insert(package.clone()) {
                    via.insert(package.clone(), parent);
                    let member = ws
                        .package(&package)
                        .expect("a workspace crate has a manifest");
                    push_member_deps(member, &mut stack);
                }
                continue;
            }
            for locked in lock.find(&package, version.as_deref()) {
                if !seen.insert((locked.name.clone(), locked.version.clone())) {
                    continue;
                }
                via.entry(locked.name.clone())
                    .or_insert_with(|| parent.clone());
                if is_runtime_or_network(&locked.name) {
                    violations.push(format!(
                        "{name} pulls in {} {} through {}: no async runtime or network stack below the node",
                        locked.name,
                        locked.version,
                        chain(&via, &locked.name, name)
                    ));
                }
                for (dep, dep_version) in &locked.deps {
                    stack.push((dep.clone(), dep_version.clone(), locked.name.clone()));
                }
            }
        }
    }
    violations
}

/// `root -> a -> b -> package`, from the `via` links.
/// The crates.io packages of `lock` that `reviewed` (`name version` a line, `#` comments)
/// does not list, and the listed ones the lock no longer holds.
fn check_dependencies_reviewed(lock: &Lock, reviewed: &str) -> Vec<String> {
    let listed: BTreeSet<(&str, &str)> = reviewed
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| line.split_once(' '))
        .collect();
    let locked: BTreeSet<(&str, &str)> = (lock.packages.iter())
        .filter(|package| package.registry)
        .map(|package| (package.name.as_str(), package.version.as_str()))
        .collect();
    let unreviewed = locked.difference(&listed).map(|(name, version)| {
        format!(
            "{name} {version} is in Cargo.lock but not in docs/dependencies-reviewed.txt: \
             review its advisories (ARCHITECTURE.md, \"Dependency advisories\"), then list it"
        )
    });
    let gone = listed.difference(&locked).map(|(name, version)| {
        format!("{name} {version} is listed as reviewed but no longer in Cargo.lock: remove it")
    });
    unreviewed.chain(gone).collect()
}

fn chain(via: &BTreeMap<String, String>, package: &str, root: &str) -> String {
    let mut links = vec![package.to_string()];
    let mut at = package;
    while let Some(parent) = via.get(at) {
        if parent == root || links.len() > 64 {
            break;
        }
        links.push(parent.clone());
        at = parent;
    }
    links.push(root.to_string());
    links.reverse();
    links.join(" -> ")
}

/// The root says `publish = false` once; every package inherits it.
fn check_unpublished(ws: &Workspace) -> Vec<String> {
    let mut violations = Vec::new();
    let root_publish = ws.workspace_table("package").and_then(|p| p.get("publish"));
    if root_publish.and_then(Value::as_bool) != Some(false) {
        violations.push("Cargo.toml: [workspace.package] must say publish = false".to_string());
    }
    for package in ws.packages() {
        if !package
            .package()
            .get("publish")
            .is_some_and(is_workspace_ref)
        {
            violations.push(format!(
                "{}: {} must say publish.workspace = true (internal crates are never published)",
                package.path(),
                package.name()
            ));
        }
    }
    violations
}

/// Every package says `[lints] workspace = true`, and the root has `[workspace.lints]`.
fn check_workspace_lints(ws: &Workspace) -> Vec<String> {
    let mut violations = Vec::new();
    if ws.workspace_table("lints").is_none() {
        violations.push("Cargo.toml: has no [workspace.lints]".to_string());
    }
    for package in ws.packages() {
        if !package.table.get("lints").is_some_and(is_workspace_ref) {
            violations.push(format!(
                "{}: {} must say [lints] workspace = true",
                package.path(),
                package.name()
            ));
        }
    }
    violations
}

/// `rust-version` is a literal only in `[workspace.package]`; packages inherit it, and no
/// `rust-toolchain` file pins a second version beside it.
fn check_rust_version_in_one_place(ws: &Workspace, root_files: &[String]) -> Vec<String> {
    let mut violations = Vec::new();
    let root_version = ws
        .workspace_table("package")
        .and_then(|p| p.get("rust-version"));
    if root_version.and_then(Value::as_str).is_none() {
        violations.push("Cargo.toml: [workspace.package] must set rust-version".to_string());
    }
    for package in ws.packages() {
        match package.package().get("rust-version") {
            Some(spec) if is_workspace_ref(spec) => {}
            Some(spec) => violations.push(format!(
                "{}: {} sets rust-version = {spec}; inherit it with rust-version.workspace = true",
                package.path(),
                package.name()
            )),
            None => violations.push(format!(
                "{}: {} must inherit rust-version.workspace = true",
                package.path(),
                package.name()
            )),
        }
    }
    for file in root_files {
        if file == "rust-toolchain" || file == "rust-toolchain.toml" {
            violations.push(format!(
                "{file}: pins a toolchain beside [workspace.package] rust-version; the version lives in one place"
            ));
        }
    }
    violations
}

/// Every dependency is declared once, in `[workspace.dependencies]`, and packages refer to
/// it with `.workspace = true` (one version per dependency).
fn check_dependencies_from_workspace(ws: &Workspace) -> Vec<String> {
    let declared = ws.workspace_table("dependencies");
    let mut violations = Vec::new();
    for package in ws.packages() {
        for dep in ws.deps(package) {
            if !is_workspace_ref(&dep.spec) {
                violations.push(format!(
                    "{}: {} declares its own {}; declare it in [workspace.dependencies] and write \
                     `{}.workspace = true`",
                    package.path(),
                    package.name(),
                    dep.place(),
                    dep.key
                ));
            } else if !declared.is_some_and(|d| d.contains_key(&dep.key)) {
                violations.push(format!(
                    "{}: {} inherits {} but [workspace.dependencies] has no {}",
                    package.path(),
                    package.name(),
                    dep.place(),
                    dep.key
                ));
            }
        }
    }
    violations
}

/// bincode is `=2.0.1` in every manifest that names it and in `Cargo.lock`.
fn check_bincode_pinned(ws: &Workspace, lock: &Lock) -> Vec<String> {
    let mut violations = Vec::new();
    let pinned = |spec: &Value| {
        let version = spec
            .as_str()
            .or_else(|| spec.get("version").and_then(Value::as_str));
        version == Some(BINCODE_PIN) && spec.get("git").is_none() && spec.get("path").is_none()
    };
    if let Some(declared) = ws.workspace_table("dependencies") {
        for (key, spec) in declared {
            let package = spec.get("package").and_then(Value::as_str).unwrap_or(key);
            if package == "bincode" && !pinned(spec) {
                violations.push(format!(
                    "Cargo.toml: [workspace.dependencies] {key} = {spec} must be version \"{BINCODE_PIN}\" from crates.io"
                ));
            }
        }
    }
    for package in ws.packages() {
        for dep in ws.deps(package) {
            if dep.package == "bincode" && !is_workspace_ref(&dep.spec) && !pinned(&dep.spec) {
                violations.push(format!(
                    "{}: {} = {} must be version \"{BINCODE_PIN}\"",
                    package.path(),
                    dep.place(),
                    dep.spec
                ));
            }
        }
    }
    for locked in lock.find("bincode", None) {
        if format!("={}", locked.version) != BINCODE_PIN {
            violations.push(format!(
                "Cargo.lock: bincode {} is locked; only {} is allowed",
                locked.version,
                BINCODE_PIN.trim_start_matches('=')
            ));
        }
    }
    violations
}

// ---------------------------------------------------------------------------------------
// Cargo.lock.
// ---------------------------------------------------------------------------------------

struct Lock {
    packages: Vec<LockedPackage>,
}

struct LockedPackage {
    name: String,
    version: String,
    /// Whether it comes from crates.io (the workspace's own packages have no source).
    registry: bool,
    /// `(name, Some(version))` when the lock had to say which version.
    deps: Vec<(String, Option<String>)>,
}

impl Lock {
    fn parse(text: &str) -> Lock {
        let table = text
            .parse::<Table>()
            .unwrap_or_else(|e| panic!("Cargo.lock does not parse: {e}"));
        let field = |p: &Value, key: &str| {
            p.get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let packages = table
            .get("package")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|p| LockedPackage {
                name: field(p, "name"),
                version: field(p, "version"),
                registry: field(p, "source").starts_with("registry+"),
                deps: p
                    .get("dependencies")
                    .and_then(Value::as_array)
                    .map(Vec::as_slice)
                    .unwrap_or_default()
                    .iter()
                    .filter_map(Value::as_str)
                    .map(|d| {
                        // "name", "name version", or "name version (source)".
                        let mut words = d.split_whitespace();
                        let name = words.next().unwrap_or_default().to_string();
                        (name, words.next().map(str::to_string))
                    })
                    .collect(),
            })
            .collect();
        Lock { packages }
    }

    fn find<'a>(
        &'a self,
        name: &'a str,
        version: Option<&'a str>,
    ) -> impl Iterator<Item = &'a LockedPackage> {
        self.packages
            .iter()
            .filter(move |p| p.name == name && version.is_none_or(|v| p.version == v))
    }
}

// ---------------------------------------------------------------------------------------
// Checks over sources.
// ---------------------------------------------------------------------------------------

/// `sources` are `(path relative to the workspace root, text)` of `crdt/src` and
/// `gossip/src`. None uses anything in `FORBIDDEN_IN_PURE_SOURCES`, except what gossip's
/// simulator module may use, and that module exists only behind `cfg(feature = "sim")`.
fn check_pure_sources(sources: &[(String, String)]) -> Vec<String> {
    let mut violations = Vec::new();
    let is_sim = |path: &str| path == "gossip/src/sim.rs" || path.starts_with("gossip/src/sim/");
    for (path, text) in sources {
        let code = code_only(text);
        for forbidden in FORBIDDEN_IN_PURE_SOURCES {
            if forbidden.sim_may_use && is_sim(path) {
                continue;
            }
            if uses(&code, forbidden.pattern) {
                violations.push(format!(
                    "{path}: uses `{}`: {}",
                    forbidden.pattern, forbidden.why
                ));
            }
        }
    }
    if sources.iter().any(|(path, _)| is_sim(path)) {
        let lib = sources.iter().find(|(path, _)| path == "gossip/src/lib.rs");
        if !lib.is_some_and(|(_, text)| sim_is_feature_gated(text)) {
            violations.push(
                "gossip/src/lib.rs: the simulator module must be declared as \
                 `#[cfg(feature = \"sim\")] mod sim;`"
                    .to_string(),
            );
        }
    }
    violations
}

/// Every bincode configuration is built with its decode limit in the same expression:
/// `config::standard().with_limit::<N>()`, never a bare `config::standard()` or `legacy()`.
fn check_bincode_limits(sources: &[(String, String)]) -> Vec<String> {
    let mut violations = Vec::new();
    for (path, text) in sources {
        let code = squashed_code(text);
        for constructor in ["config::standard()", "config::legacy()"] {
            for (at, _) in code.match_indices(constructor) {
                if !code[at + constructor.len()..].starts_with(".with_limit::<") {
                    violations.push(format!(
                        "{path}: `{constructor}` without `.with_limit::<N>()` in the same expression: \
                         every decode has a limit"
                    ));
                }
            }
        }
    }
    violations
}

/// [`code_only`] of `text` without whitespace: an expression split over lines reads as
/// one.
fn squashed_code(text: &str) -> String {
    code_only(text)
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect()
}

/// A package that depends on bincode builds its config where [`check_bincode_limits`]
/// sees it: else that check passes having seen nothing (a config built another way, say
/// from an imported `standard()`, would go unchecked).
fn check_bincode_config_found(package: &str, sources: &[(String, String)]) -> Vec<String> {
    let found = sources.iter().any(|(_, text)| {
        let code = squashed_code(text);
        code.contains("config::standard()") || code.contains("config::legacy()")
    });
    if found {
        return Vec::new();
    }
    vec![format!(
        "{package} depends on bincode, but no `config::standard()` or `config::legacy()` is in \
         its src: the decode-limit check saw nothing to check"
    )]
}

/// Every paragraph of ARCHITECTURE.md that states an "Architecture Invariant:" says
/// "Enforced by:"; every `architecture::name` it cites is a test in `this_file`; and every
/// test in `this_file` above the negative controls is cited somewhere in the document.
fn check_invariants_documented(doc: &str, this_file: &str) -> Vec<String> {
    let mut violations = Vec::new();
    let tests = workspace_tests(this_file);
    let mut cited = BTreeSet::new();
    for paragraph in doc.split("\n\n") {
        for (at, _) in paragraph.match_indices("architecture::") {
            let name: String = paragraph[at + "architecture::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !tests.contains(&name) {
                violations.push(format!(
                    "ARCHITECTURE.md cites architecture::{name}, which is not a test there"
                ));
            }
            cited.insert(name);
        }
        if paragraph.contains("Architecture Invariant:") && !paragraph.contains("Enforced by:") {
            let first = paragraph.trim().lines().next().unwrap_or_default();
            violations.push(format!(
                "ARCHITECTURE.md: the invariant \"{first}\" does not say what enforces it (\"Enforced by:\")"
            ));
        }
    }
    if !doc.contains("Architecture Invariant:") {
        violations.push("ARCHITECTURE.md states no Architecture Invariant".to_string());
    }
    for test in tests.difference(&cited) {
        violations.push(format!("ARCHITECTURE.md never cites architecture::{test}"));
    }
    violations
}

/// The `#[test]` functions of `file` before its `mod negative_controls`.
fn workspace_tests(file: &str) -> BTreeSet<String> {
    let end = file.find("\nmod negative_controls {").unwrap_or(file.len());
    let mut tests = BTreeSet::new();
    let mut lines = file[..end].lines().map(str::trim);
    while let Some(line) = lines.next() {
        if line == "#[test]" {
            if let Some(name) = lines.next().and_then(|l| l.strip_prefix("fn ")) {
                tests.insert(name.split('(').next().unwrap_or_default().to_string());
            }
        }
    }
    tests
}

/// Whether `text` declares `mod sim` right after a `cfg` attribute that names the `sim`
/// feature: `#[cfg(feature = "sim")]` or `#[cfg(any(test, feature = "sim"))]`.
fn sim_is_feature_gated(text: &str) -> bool {
    // Comments go, literals stay: the feature's name is a literal.
    let squashed: String = strip(text, false)
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let mut declarations = 0;
    for declaration in ["modsim;", "modsim{"] {
        for (at, _) in squashed.match_indices(declaration) {
            declarations += 1;
            let before = &squashed[..at];
            // The attributes of this item: everything since the previous item ended.
            let attributes = &before[before.rfind([';', '}']).map_or(0, |i| i + 1)..];
            if !(attributes.contains("#[cfg(") && attributes.contains("feature=\"sim\"")) {
                return false;
            }
        }
    }
    declarations > 0
}

/// `src` with comments removed and the contents of string and character literals blanked,
/// so a doc comment that says "never calls `Instant::now`" is not a use of it.
fn code_only(src: &str) -> String {
    strip(src, true)
}

/// `src` without comments, with literals blanked if `blank_literals`, and with whitespace
/// collapsed to one space and dropped next to `:`, so `std :: net` reads as `std::net`.
fn strip(src: &str, blank_literals: bool) -> String {
    let chars: Vec<char> = src.chars().collect();
    let is_ident = |c: Option<&char>| c.is_some_and(|c| c.is_alphanumeric() || *c == '_');
    let mut out = String::with_capacity(src.len());
    // Copies `chars[from..to]`, or a blank literal of the same kind.
    let literal = |out: &mut String, from: usize, to: usize, blank: &str| {
        if blank_literals {
            out.push_str(blank);
        } else {
            out.extend(&chars[from..to.min(chars.len())]);
        }
    };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let prev = i.checked_sub(1).and_then(|p| chars.get(p));
        let prev2 = i.checked_sub(2).and_then(|p| chars.get(p));
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            // Block comments nest.
            let mut depth = 0usize;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r'
            && matches!(next, Some('"') | Some('#'))
            && (!is_ident(prev) || (matches!(prev, Some('b') | Some('c')) && !is_ident(prev2)))
        {
            // A raw string `r#"..."#` (or `br"..."`), or a raw identifier `r#name`.
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) == Some(&'"') {
                j += 1;
                while j < chars.len() {
                    if chars[j] == '"' && (1..=hashes).all(|k| chars.get(j + k) == Some(&'#')) {
                        j += 1 + hashes;
                        break;
                    }
                    j += 1;
                }
                literal(&mut out, i, j, "\"\"");
                i = j;
            } else {
                out.push(c);
                i += 1;
            }
        } else if c == '"' {
            let mut j = i + 1;
            while j < chars.len() {
                match chars[j] {
                    '\\' => j += 2,
                    '"' => {
                        j += 1;
                        break;
                    }
                    _ => j += 1,
                }
            }
            literal(&mut out, i, j, "\"\"");
            i = j;
        } else if c == '\'' && next == Some('\\') {
            // An escaped character literal: '\n', '\'', '\u{1F600}'.
            let mut j = i + 3;
            while j < chars.len() && chars[j] != '\'' {
                j += 1;
            }
            literal(&mut out, i, j + 1, "' '");
            i = j + 1;
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            literal(&mut out, i, i + 3, "' '");
            i += 3;
        } else {
            // Code, including lifetimes (`'a`).
            out.push(c);
            i += 1;
        }
    }
    squash_paths(&out)
}

/// Collapses whitespace to one space and drops it next to `:`, so paths read the same
/// however they are spaced or broken across lines.
fn squash_paths(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut pending_space = false;
    for c in code.chars() {
        if c.is_whitespace() {
            pending_space = true;
            continue;
        }
        if pending_space && c != ':' && !out.ends_with(':') && !out.is_empty() {
            out.push(' ');
        }
        pending_space = false;
        out.push(c);
    }
    out
}

/// Whether `code` uses `pattern` as whole words, including `std::{fs, net}` groups.
fn uses(code: &str, pattern: &str) -> bool {
    let is_ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    let direct = code.match_indices(pattern).any(|(at, _)| {
        !is_ident(code[..at].chars().next_back())
            && !is_ident(code[at + pattern.len()..].chars().next())
    });
    direct
        || pattern
            .strip_prefix("std::")
            .is_some_and(|module| std_groups(code).contains(module))
}

/// The first segment of every item in every `std::{...}` group: `use std::{fs::File, io}`
/// gives `fs` and `io`.
fn std_groups(code: &str) -> BTreeSet<String> {
    let mut modules = BTreeSet::new();
    for (at, _) in code.match_indices("std::{") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let body = &code[at + "std::{".len()..];
        let (mut depth, mut item) = (0usize, String::new());
        for c in body.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    modules.insert(first_segment(&item));
                    item.clear();
                    continue;
                }
                _ => {}
            }
            item.push(c);
        }
        modules.insert(first_segment(&item));
    }
    modules
}

/// `fs` for `fs::File`, `net` for `net as n`.
fn first_segment(item: &str) -> String {
    let head = item.split("::").next().unwrap_or_default();
    head.split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

// ---------------------------------------------------------------------------------------
// Reading the workspace.
// ---------------------------------------------------------------------------------------

fn root() -> &'static Path {
    // The root package `tally` lives at the workspace root.
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
}

fn workspace() -> Workspace {
    let root_text = read("Cargo.toml");
    let dirs = Workspace::member_dirs(&Manifest::parse(".", &root_text));
    let texts: Vec<(String, String)> = dirs
        .into_iter()
        .map(|dir| (dir.clone(), read(&format!("{dir}/Cargo.toml"))))
        .collect();
    let members: Vec<(&str, &str)> = texts
        .iter()
        .map(|(d, t)| (d.as_str(), t.as_str()))
        .collect();
    Workspace::parse(&root_text, &members)
}

/// Every `.rs` file under `dir` (relative to the root), as `(relative path, text)`.
fn rust_files(dir: &str) -> Vec<(String, String)> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_string()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(root().join(&dir)) else {
            continue;
        };
        for entry in entries {
            let entry = entry.expect("a directory entry");
            let path = format!("{dir}/{}", entry.file_name().to_string_lossy());
            if entry.file_type().expect("a file type").is_dir() {
                pending.push(path);
            } else if path.ends_with(".rs") {
                let text = read(&path);
                files.push((path, text));
            }
        }
    }
    files.sort();
    files
}

#[track_caller]
fn assert_none(violations: Vec<String>) {
    assert!(
        violations.is_empty(),
        "{} violation(s) of ARCHITECTURE.md:\n  {}",
        violations.len(),
        violations.join("\n  ")
    );
}

// ---------------------------------------------------------------------------------------
// Negative controls: every check, fed a text that breaks its invariant, reports it.
// ---------------------------------------------------------------------------------------

mod negative_controls {
    use super::*;

    /// A workspace that keeps every invariant; each control breaks one thing in it.
    const ROOT: &str = r#"
[workspace]
members = ["crdt", "gossip", "node", "client"]

[workspace.package]
rust-version = "1.88"
publish = false

[workspace.dependencies]
tally-crdt = { path = "crdt" }
tally-gossip = { path = "gossip" }
tally-node = { path = "node" }
tally-client = { path = "client" }
bincode = { version = "=2.0.1", default-features = false }
serde = "1"
tokio = "1"

[workspace.lints.rust]
unsafe_code = "forbid"

[package]
name = "tally"
rust-version.workspace = true
publish.workspace = true

[dependencies]
tally-node.workspace = true

[lints]
workspace = true
"#;

    fn member(name: &str, deps: &str) -> String {
        format!(
            "[package]\nname = \"{name}\"\nrust-version.workspace = true\npublish.workspace = true\n\n\
             {deps}\n\n[lints]\nworkspace = true\n"
        )
    }

    /// The good workspace, with `crdt`'s manifest replaced when `crdt` is `Some`, and so on.
    fn ws_with(
        root: &str,
        crdt: Option<&str>,
        gossip: Option<&str>,
        client: Option<&str>,
    ) -> Workspace {
        let crdt = crdt.map_or_else(
            || member("tally-crdt", "[dependencies]\nserde.workspace = true"),
            str::to_string,
        );
        let gossip = gossip.map_or_else(
            || {
                member(
                    "tally-gossip",
                    "[dependencies]\ntally-crdt.workspace = true",
                )
            },
            str::to_string,
        );
        let node = member(
            "tally-node",
            "[dependencies]\ntally-crdt.workspace = true\ntally-gossip.workspace = true\ntokio.workspace = true",
        );
        let client = client.map_or_else(|| member("tally-client", ""), str::to_string);
        Workspace::parse(
            root,
            &[
                ("crdt", &crdt),
                ("gossip", &gossip),
                ("node", &node),
                ("client", &client),
            ],
        )
    }

    fn good() -> Workspace {
        ws_with(ROOT, None, None, None)
    }

    const GOOD_LOCK: &str = r#"
[[package]]
name = "serde"
version = "1.0.0"

[[package]]
name = "bincode"
version = "2.0.1"
"#;

    #[track_caller]
    fn assert_reported(violations: Vec<String>, expected: &str) {
        assert!(
            violations.iter().any(|v| v.contains(expected)),
            "expected a violation mentioning {expected:?}, got {violations:#?}"
        );
    }

    #[test]
    fn the_good_workspace_passes_every_check() {
        let ws = good();
        let lock = Lock::parse(GOOD_LOCK);
        for name in ["tally-crdt", "tally-gossip", "tally-node", "tally-client"] {
            assert_none(check_workspace_deps_of(&ws, name));
        }
        assert_none(check_dependency_line(&ws));
        assert_none(check_no_runtime_deps(&ws));
        assert_none(check_no_runtime_deps_transitively(&ws, &lock));
        assert_none(check_unpublished(&ws));
        assert_none(check_workspace_lints(&ws));
        assert_none(check_rust_version_in_one_place(
            &ws,
            &["Cargo.toml".to_string()],
        ));
        assert_none(check_dependencies_from_workspace(&ws));
        assert_none(check_bincode_pinned(&ws, &lock));
    }

    #[test]
    fn crdt_depending_on_gossip_is_reported() {
        let crdt = member(
            "tally-crdt",
            "[dev-dependencies]\ntally-gossip.workspace = true",
        );
        let ws = ws_with(ROOT, Some(&crdt), None, None);
        assert_reported(
            check_workspace_deps_of(&ws, "tally-crdt"),
            "depends on workspace crate tally-gossip",
        );
        assert_reported(
            check_dependency_line(&ws),
            "tally-crdt depends on workspace crate tally-gossip",
        );
    }

    #[test]
    fn crdt_depending_on_a_renamed_workspace_crate_is_reported() {
        let crdt = member(
            "tally-crdt",
            "[dependencies]\nnet = { path = \"../node\", package = \"tally-node\" }",
        );
        let ws = ws_with(ROOT, Some(&crdt), None, None);
        assert_reported(check_workspace_deps_of(&ws, "tally-crdt"), "tally-node");
    }

    #[test]
    fn gossip_depending_on_node_is_reported() {
        let gossip = member(
            "tally-gossip",
            "[dependencies]\ntally-crdt.workspace = true\n[target.'cfg(unix)'.dependencies]\ntally-node.workspace = true",
        );
        let ws = ws_with(ROOT, None, Some(&gossip), None);
        assert_reported(
            check_workspace_deps_of(&ws, "tally-gossip"),
            "depends on workspace crate tally-node",
        );
    }

    #[test]
    fn client_depending_on_crdt_is_reported() {
        let client = member(
            "tally-client",
            "[dependencies]\ntally-crdt.workspace = true",
        );
        let ws = ws_with(ROOT, None, None, Some(&client));
        assert_reported(
            check_workspace_deps_of(&ws, "tally-client"),
            "depends on workspace crate tally-crdt",
        );
    }

    #[test]
    fn gossip_not_depending_on_crdt_breaks_the_line() {
        let gossip = member("tally-gossip", "[dependencies]");
        let ws = ws_with(ROOT, None, Some(&gossip), None);
        assert_reported(
            check_dependency_line(&ws),
            "tally-gossip does not depend on tally-crdt",
        );
    }

    #[test]
    fn a_crate_with_no_place_in_the_line_is_reported() {
        let client = member("tally-extra", "");
        let ws = ws_with(ROOT, None, None, Some(&client));
        assert_reported(
            check_dependency_line(&ws),
            "tally-extra has no place in the dependency line",
        );
    }

    #[test]
    fn a_tokio_dependency_in_crdt_is_reported() {
        let crdt = member("tally-crdt", "[dependencies]\ntokio.workspace = true");
        let ws = ws_with(ROOT, Some(&crdt), None, None);
        assert_reported(check_no_runtime_deps(&ws), "tally-crdt depends on tokio");
    }

    #[test]
    fn a_quinn_proto_dependency_in_gossip_behind_a_target_is_reported() {
        let gossip = member(
            "tally-gossip",
            "[dependencies]\ntally-crdt.workspace = true\n[target.'cfg(unix)'.dependencies]\nquinn-proto = \"0.11\"",
        );
        let ws = ws_with(ROOT, None, Some(&gossip), None);
        assert_reported(
            check_no_runtime_deps(&ws),
            "tally-gossip depends on quinn-proto",
        );
    }

    #[test]
    fn socket2_and_mio_in_gossip_are_reported() {
        let gossip = member(
            "tally-gossip",
            "[dependencies]\ntally-crdt.workspace = true\nsocket2 = \"0.5\"\nevents = { version = \"1\", package = \"mio\" }",
        );
        let ws = ws_with(ROOT, None, Some(&gossip), None);
        let violations = check_no_runtime_deps(&ws);
        assert_reported(violations.clone(), "depends on socket2");
        assert_reported(violations, "depends on mio");
    }

    #[test]
    fn a_tokio_dev_dependency_in_crdt_is_allowed() {
        let crdt = member("tally-crdt", "[dev-dependencies]\ntokio.workspace = true");
        let ws = ws_with(ROOT, Some(&crdt), None, None);
        assert_none(check_no_runtime_deps(&ws));
    }

    #[test]
    fn a_runtime_reached_through_another_crate_is_reported_with_its_chain() {
        let crdt = member("tally-crdt", "[dependencies]\nserde.workspace = true");
        let ws = ws_with(ROOT, Some(&crdt), None, None);
        let lock = Lock::parse(
            r#"
[[package]]
name = "serde"
version = "1.0.0"
dependencies = ["chitchat 0.8.0 (registry+https://example.invalid)"]

[[package]]
name = "chitchat"
version = "0.8.0"
dependencies = ["tokio"]

[[package]]
name = "tokio"
version = "1.0.0"
"#,
        );
        let violations = check_no_runtime_deps_transitively(&ws, &lock);
        assert_reported(
            violations.clone(),
            "tally-crdt pulls in tokio 1.0.0 through tally-crdt -> serde -> chitchat -> tokio",
        );
        // gossip reaches it through crdt as well.
        assert_reported(violations, "tally-gossip pulls in tokio");
    }

    #[test]
    fn a_member_that_can_be_published_is_reported() {
        let client = "[package]\nname = \"tally-client\"\nrust-version.workspace = true\npublish = true\n[lints]\nworkspace = true\n";
        let ws = ws_with(ROOT, None, None, Some(client));
        assert_reported(
            check_unpublished(&ws),
            "tally-client must say publish.workspace = true",
        );
        let root = ROOT.replace("publish = false", "publish = true");
        assert_reported(
            check_unpublished(&ws_with(&root, None, None, None)),
            "publish = false",
        );
    }

    #[test]
    fn a_member_with_its_own_lints_is_reported() {
        let client = "[package]\nname = \"tally-client\"\nrust-version.workspace = true\npublish.workspace = true\n[lints.rust]\nunsafe_code = \"allow\"\n";
        let ws = ws_with(ROOT, None, None, Some(client));
        assert_reported(
            check_workspace_lints(&ws),
            "tally-client must say [lints] workspace = true",
        );
    }

    #[test]
    fn a_second_rust_version_is_reported() {
        let client = "[package]\nname = \"tally-client\"\nrust-version = \"1.70\"\npublish.workspace = true\n[lints]\nworkspace = true\n";
        let ws = ws_with(ROOT, None, None, Some(client));
        assert_reported(
            check_rust_version_in_one_place(&ws, &[]),
            "tally-client sets rust-version = \"1.70\"",
        );
        assert_reported(
            check_rust_version_in_one_place(&good(), &["rust-toolchain.toml".to_string()]),
            "rust-toolchain.toml: pins a toolchain",
        );
    }

    #[test]
    fn a_dependency_with_its_own_version_is_reported() {
        let crdt = member("tally-crdt", "[dependencies]\nserde = \"1.0.200\"");
        let ws = ws_with(ROOT, Some(&crdt), None, None);
        assert_reported(
            check_dependencies_from_workspace(&ws),
            "declares its own [dependencies] serde",
        );
    }

    #[test]
    fn bincode_3_anywhere_is_reported() {
        let root = ROOT.replace("\"=2.0.1\"", "\"2\"");
        let ws = ws_with(&root, None, None, None);
        assert_reported(
            check_bincode_pinned(&ws, &Lock::parse(GOOD_LOCK)),
            "[workspace.dependencies] bincode",
        );

        let gossip = member(
            "tally-gossip",
            "[dependencies]\ntally-crdt.workspace = true\nbincode = \"3.0.0\"",
        );
        let ws = ws_with(ROOT, None, Some(&gossip), None);
        assert_reported(
            check_bincode_pinned(&ws, &Lock::parse(GOOD_LOCK)),
            "[dependencies] bincode",
        );

        let lock = Lock::parse(&GOOD_LOCK.replace("2.0.1", "3.0.0"));
        assert_reported(
            check_bincode_pinned(&good(), &lock),
            "Cargo.lock: bincode 3.0.0",
        );
    }

    fn source(path: &str, text: &str) -> Vec<(String, String)> {
        vec![(path.to_string(), text.to_string())]
    }

    #[test]
    fn each_forbidden_use_in_crdt_sources_is_reported() {
        let uses = [
            ("use std::net::UdpSocket;", "std::net"),
            ("use std::{collections::BTreeMap, fs::File};", "std::fs"),
            ("use std :: {io, net};", "std::net"),
            ("fn f() { let _ = ::std::fs::read(\"x\"); }", "std::fs"),
            ("async fn f() { tokio::task::yield_now().await }", "tokio"),
            ("use quinn::Endpoint;", "quinn"),
            (
                "fn f() -> std::time::Instant { std::time::Instant::now() }",
                "Instant::now",
            ),
            ("fn f() { let _ = SystemTime :: now(); }", "SystemTime::now"),
            ("fn f() -> u8 { rand::thread_rng().gen() }", "thread_rng"),
            ("fn f() -> u8 { rand::random() }", "rand::random"),
        ];
        for (code, pattern) in uses {
            assert_reported(
                check_pure_sources(&source("crdt/src/lane.rs", code)),
                &format!("uses `{pattern}`"),
            );
        }
    }

    #[test]
    fn mentions_in_comments_and_strings_are_not_uses() {
        let text = r##"
//! Never uses tokio, quinn, std::net or std::fs; never calls Instant::now.
/// See `SystemTime::now` /* nested /* thread_rng */ comment */.
fn f() -> &'static str { let _c = '\''; let _l: &'static str = r#"tokio "quoted" quinn"#; "std::fs \" Instant::now" }
"##;
        assert_none(check_pure_sources(&source("gossip/src/lib.rs", text)));
    }

    #[test]
    fn words_that_merely_contain_a_pattern_are_not_uses() {
        let text = "struct MyInstant; fn tokio_free() {} fn f(mystd: u8) { let quinnish = 1; }";
        assert_none(check_pure_sources(&source("crdt/src/lane.rs", text)));
    }

    #[test]
    fn the_simulator_may_use_addresses_but_never_the_clock() {
        let lib = "#[cfg(feature = \"sim\")]\npub mod sim;\n";
        let sim = "use std::net::SocketAddr; fn now() -> std::time::Instant { std::time::Instant::now() }";
        let sources = vec![
            ("gossip/src/lib.rs".to_string(), lib.to_string()),
            ("gossip/src/sim/network.rs".to_string(), sim.to_string()),
        ];
        let violations = check_pure_sources(&sources);
        assert_eq!(violations.len(), 1, "{violations:#?}");
        assert_reported(violations, "gossip/src/sim/network.rs: uses `Instant::now`");
    }

    #[test]
    fn a_simulator_module_without_the_feature_gate_is_reported() {
        let sources = vec![
            (
                "gossip/src/lib.rs".to_string(),
                "pub mod sim;\n".to_string(),
            ),
            (
                "gossip/src/sim.rs".to_string(),
                "pub struct Network;".to_string(),
            ),
        ];
        assert_reported(
            check_pure_sources(&sources),
            "must be declared as `#[cfg(feature = \"sim\")] mod sim;`",
        );
    }

    #[test]
    fn a_sim_module_in_crdt_gets_no_exemption() {
        let violations =
            check_pure_sources(&source("crdt/src/sim.rs", "use std::net::SocketAddr;"));
        assert_reported(violations, "crdt/src/sim.rs: uses `std::net`");
    }

    #[test]
    fn a_bincode_config_without_a_limit_is_reported() {
        let bare =
            "fn decode(b: &[u8]) { bincode::decode_from_slice(b, bincode::config::standard()); }";
        assert_reported(
            check_bincode_limits(&source("gossip/src/wire.rs", bare)),
            "without `.with_limit::<N>()`",
        );
        let legacy = "const C: () = config::legacy();";
        assert_reported(
            check_bincode_limits(&source("node/src/wire.rs", legacy)),
            "config::legacy()",
        );
        let limited = "const CONFIG: C = bincode::config::standard()\n    .with_limit::<65536>();";
        assert_none(check_bincode_limits(&source("gossip/src/wire.rs", limited)));
    }

    #[test]
    fn a_bincode_user_whose_config_the_check_cannot_see_is_reported() {
        let imported =
            "use bincode::config::standard;\nconst C: () = standard().with_limit::<64>();";
        assert_reported(
            check_bincode_config_found("tally-gossip", &source("gossip/src/wire.rs", imported)),
            "tally-gossip depends on bincode",
        );
        let qualified = "const C: () = bincode::config::standard().with_limit::<64>();";
        assert_none(check_bincode_config_found(
            "tally-gossip",
            &source("gossip/src/wire.rs", qualified),
        ));
    }

    #[test]
    fn an_invariant_without_its_enforcement_is_reported() {
        let this_file = "#[test]\nfn real_check() {}\nmod negative_controls {}\n";
        let doc =
            "Architecture Invariant: lanes only grow.\n\nEnforced by: architecture::real_check.\n";
        assert_reported(
            check_invariants_documented(doc, this_file),
            "does not say what enforces it",
        );
    }

    #[test]
    fn citing_a_test_that_does_not_exist_is_reported() {
        let this_file = "#[test]\nfn real_check() {}\nmod negative_controls {}\n";
        let doc = "Architecture Invariant: x.\nEnforced by: architecture::real_check, architecture::gone.\n";
        assert_reported(
            check_invariants_documented(doc, this_file),
            "cites architecture::gone",
        );
    }

    #[test]
    fn a_test_that_the_document_never_cites_is_reported() {
        let this_file =
            "#[test]\nfn real_check() {}\n#[test]\nfn forgotten() {}\nmod negative_controls {}\n";
        let doc = "Architecture Invariant: x.\nEnforced by: architecture::real_check.\n";
        assert_reported(
            check_invariants_documented(doc, this_file),
            "never cites architecture::forgotten",
        );
    }
}

//! Network faults between a cluster's nodes, with nftables: a partition between two
//! groups, a cut one way, or loss on every link. The UDP datagrams (QUIC) a fault takes
//! are dropped as they arrive, on the `input` hook. That is silent loss, as on a cut link:
//! a drop on `output` would instead fail the sender's `sendmsg` with `EPERM`. The client
//! ports (TCP, from 127.0.0.1) are never touched. Needs root and the `nft` command
//! (`nftables`, which `.ci/run` installs).

use std::io::Write;
use std::process::{Command, Stdio};

/// Holds a fault until [`NetFault::heal`] or a drop.
pub struct NetFault {
    table: String,
    healed: bool,
}

/// Drops the datagrams from `from` to `to`.
pub fn cut(from: &[String], to: &[String]) -> String {
    format!(
        "ip saddr {{ {} }} ip daddr {{ {} }} meta l4proto udp counter drop",
        from.join(", "),
        to.join(", ")
    )
}

/// Drops `percent` in a hundred of the datagrams between any two of `among`, at random.
pub fn loss(among: &[String], percent: u8) -> String {
    let among = among.join(", ");
    format!(
        "ip saddr {{ {among} }} ip daddr {{ {among} }} meta l4proto udp \
         numgen random mod 100 < {percent} counter drop"
    )
}

impl NetFault {
    /// Applies `rules` ([`cut`], [`loss`]) in a table of its own named `table`; refused
    /// (a panic naming it) while another fault holds that table.
    pub fn new(table: String, rules: &[String]) -> NetFault {
        nft(&format!(
            "create table inet {table}\n\
             add chain inet {table} input {{ type filter hook input priority 0; policy accept; }}\n\
             {}",
            adding(&table, rules)
        ));
        NetFault {
            table,
            healed: false,
        }
    }

    /// Replaces the fault's rules with `rules`, at once (one nft transaction).
    pub fn set(&self, rules: &[String]) {
        let table = &self.table;
        nft(&format!(
            "flush chain inet {table} input\n{}",
            adding(table, rules)
        ));
    }

    /// Deletes `table` if a fault left it: one whose test was killed before its drop.
    pub fn clear_left(table: &str) {
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", table])
            .stderr(Stdio::null())
            .status();
    }

    /// The datagrams dropped so far, by the rules' counters.
    pub fn dropped(&self) -> u64 {
        let output = Command::new("nft")
            .args(["list", "table", "inet", &self.table])
            .output()
            .unwrap();
        assert!(output.status.success(), "nft list table {}", self.table);
        let listed = String::from_utf8(output.stdout).unwrap();
        let counts = listed.split("packets ").skip(1);
        counts
            .map(|rest| rest.split(' ').next().unwrap().parse::<u64>().unwrap())
            .sum()
    }

    /// Lets the datagrams through again.
    pub fn heal(mut self) {
        self.healed = true;
        nft(&format!("delete table inet {}\n", self.table));
    }
}

impl Drop for NetFault {
    fn drop(&mut self) {
        if !self.healed {
            NetFault::clear_left(&self.table);
        }
    }
}

/// The nft commands that add `rules` to `table`'s chain.
fn adding(table: &str, rules: &[String]) -> String {
    rules
        .iter()
        .map(|rule| format!("add rule inet {table} input {rule}\n"))
        .collect()
}

/// Runs `script` with `nft -f -`.
fn nft(script: &str) {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| {
            panic!("nft: {err} (the network fault tests need `nftables` and root)")
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "nft -f - <<{script}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

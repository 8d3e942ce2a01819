//! A network partition between two groups of a cluster's nodes, with nftables: the UDP
//! datagrams (QUIC) from either group's addresses to the other's are dropped as they
//! arrive, on the `input` hook. That is silent loss, as on a cut link: a drop on `output`
//! would instead fail the sender's `sendmsg` with `EPERM`. The client ports (TCP, from
//! 127.0.0.1) stay open. Needs root and the `nft` command (`nftables`, which `.ci/run`
//! installs).

use std::io::Write;
use std::process::{Command, Stdio};

/// Holds the partition until [`Partition::heal`] or a drop.
pub struct Partition {
    table: String,
    healed: bool,
}

impl Partition {
    /// Cuts the addresses `a` off from `b`, both ways, in a table of its own named `table`.
    pub fn new(table: String, a: &[String], b: &[String]) -> Partition {
        let (a, b) = (a.join(", "), b.join(", "));
        nft(&format!(
            "table inet {table} {{\n\
             \x20 chain input {{\n\
             \x20   type filter hook input priority 0; policy accept;\n\
             \x20   ip saddr {{ {a} }} ip daddr {{ {b} }} meta l4proto udp drop\n\
             \x20   ip saddr {{ {b} }} ip daddr {{ {a} }} meta l4proto udp drop\n\
             \x20 }}\n\
             }}\n"
        ));
        Partition {
            table,
            healed: false,
        }
    }

    /// Lets the datagrams through again.
    pub fn heal(mut self) {
        self.healed = true;
        nft(&format!("delete table inet {}\n", self.table));
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        if !self.healed {
            let _ = Command::new("nft")
                .args(["delete", "table", "inet", &self.table])
                .status();
        }
    }
}

/// Runs `script` with `nft -f -`.
fn nft(script: &str) {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("nft: {err} (the partition tests need `nftables` and root)"));
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

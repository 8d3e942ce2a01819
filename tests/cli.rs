//! The `tally` binary's own commands, run as an operator runs them.

#![allow(
    clippy::unwrap_used,
    reason = "a panic in a helper is the test's failure report"
)]

use std::process::Command;

/// Runs `tally certs --out dir --nodes nodes` and returns what it printed.
fn certs(dir: &std::path::Path, nodes: &str) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["certs", "--out"])
        .arg(dir)
        .args(["--nodes", nodes])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn tally_certs_run_again_says_which_nodes_files_it_replaced_and_keeps_the_ca() {
    let dir = std::env::temp_dir().join(format!("tally-cli-certs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = certs(&dir, "1,2");
    assert_eq!(first.matches("(new)").count(), 3, "{first}");
    let ca = std::fs::read(dir.join("ca.pem")).unwrap();
    let second = certs(&dir, "2,3");
    let lines: Vec<&str> = second.lines().collect();
    assert_eq!(lines.len(), 3, "{second}");
    assert!(
        lines[0].contains("node-2.pem")
            && lines[0].ends_with("(replaced: its node takes them at its next start)"),
        "{second}"
    );
    assert!(
        lines[1].contains("node-3.pem") && lines[1].ends_with("(new)"),
        "{second}"
    );
    assert!(lines[2].ends_with("ca.pem (kept)"), "{second}");
    assert_eq!(
        std::fs::read(dir.join("ca.pem")).unwrap(),
        ca,
        "the CA is kept"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn tally_forget_with_no_sidecar_on_the_http_port_fails_naming_the_port() {
    // A port just bound and let go: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["forget", "3", "--http"])
        .arg(port.to_string())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{output:?}");
    assert!(
        stderr.contains(&format!("connect to the sidecar's HTTP port {port}")),
        "{stderr}"
    );
}

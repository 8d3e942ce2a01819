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

/// Runs `tally certs --out dir --nodes nodes`, whatever it returns.
fn certs_run(dir: &std::path::Path, nodes: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["certs", "--out"])
        .arg(dir)
        .args(["--nodes", nodes])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

/// A first run that cannot write the CA's key (here a directory in the way of its temporary
/// file; a full disk does the same) must not leave the CA's certificate without it: every
/// later run is then refused as "half a CA" for a key that never existed.
#[test]
fn tally_certs_that_cannot_write_the_ca_key_leaves_no_ca_certificate_behind() {
    let dir = std::env::temp_dir().join(format!("tally-cli-half-ca-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("ca.key.tmp")).unwrap();
    let output = certs_run(&dir, "1");
    assert!(!output.status.success(), "{output:?}");
    let left = dir.join("ca.pem").exists();
    std::fs::remove_dir(dir.join("ca.key.tmp")).unwrap();
    let again = certs_run(&dir, "1");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        !left,
        "ca.pem written without ca.key; the next run says: {}",
        String::from_utf8_lossy(&again.stderr)
    );
}

/// A renewal that cannot write the node's new key must leave the node's old pair as it
/// was: its new certificate beside its old key is a pair the node refuses at its next
/// start (`tls.key: ... does not go with the certificate`).
#[test]
fn tally_certs_renewal_that_cannot_write_the_key_keeps_the_old_pair() {
    let dir = std::env::temp_dir().join(format!("tally-cli-half-node-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    certs(&dir, "1");
    let (cert, key) = (
        std::fs::read(dir.join("node-1.pem")).unwrap(),
        std::fs::read(dir.join("node-1.key")).unwrap(),
    );
    std::fs::create_dir_all(dir.join("node-1.key.tmp")).unwrap();
    let output = certs_run(&dir, "1");
    assert!(!output.status.success(), "{output:?}");
    let (cert_after, key_after) = (
        std::fs::read(dir.join("node-1.pem")).unwrap(),
        std::fs::read(dir.join("node-1.key")).unwrap(),
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(key_after, key, "the key was not written");
    assert!(
        cert_after == cert,
        "node-1.pem was replaced while node-1.key was not: a mismatched pair"
    );
}

#[test]
fn tally_certs_refuses_a_node_id_listed_twice() {
    let dir = std::env::temp_dir().join(format!("tally-cli-twice-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let output = certs_run(&dir, "1,2,1");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let wrote = dir.join("node-1.pem").exists();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!output.status.success(), "{output:?}");
    assert!(stderr.contains("node id 1 is listed twice"), "{stderr}");
    assert!(!wrote, "nothing is written");
}

#[test]
fn a_request_timeout_of_zero_is_refused_naming_the_flag() {
    // Nothing listens on the endpoint: the flag is refused before any connection.
    let output = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["incr", "api", "user-1", "--timeout-ms", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{output:?}");
    assert!(stderr.contains("--timeout-ms"), "{stderr}");
    assert!(!stderr.contains("connect"), "{stderr}");
}

/// A port on 127.0.0.1 nothing listens on now (bound and let go).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn a_node_whose_log_pipe_was_closed_keeps_serving() {
    let dir = std::env::temp_dir().join(format!("tally-cli-log-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    certs(&dir, "1");
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let gossip = udp.local_addr().unwrap();
    drop(udp);
    let (client, http) = (free_port(), free_port());
    let config = dir.join("node-1.toml");
    std::fs::write(
        &config,
        format!(
            "node_id = 1\n\
             listen_gossip = \"{gossip}\"\n\
             listen_client = \"127.0.0.1:{client}\"\n\
             listen_http = \"127.0.0.1:{http}\"\n\
             tls = {{ ca = \"{dir}/ca.pem\", cert = \"{dir}/node-1.pem\", key = \"{dir}/node-1.key\" }}\n\
             [[rules]]\nname = \"api\"\nlimit = 10\nwindow_secs = 60\n",
            dir = dir.display()
        ),
    )
    .unwrap();
    // The node's log is a pipe whose reader has gone (a log shipper that stopped): every
    // line it writes fails with a broken pipe.
    let mut node = Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("daemon")
        .arg("--config")
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(node.stderr.take());
    let endpoint = format!("127.0.0.1:{client}");
    let mut answered = None;
    for _ in 0..100 {
        let output = Command::new(env!("CARGO_BIN_EXE_tally"))
            .args(["incr", "api", "user-1", "--endpoint", &endpoint])
            .output()
            .unwrap();
        if output.status.success() {
            answered = Some(output);
            break;
        }
        if node.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let exited = node.try_wait().unwrap();
    let _ = node.kill();
    let _ = node.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(exited, None, "the node exited");
    let answered = answered.expect("the node answered");
    assert!(
        String::from_utf8_lossy(&answered.stdout).contains("estimate: 1"),
        "{answered:?}"
    );
}

#[test]
fn tally_forget_pointed_at_a_port_that_speaks_no_http_says_so_without_its_bytes() {
    // A port that answers as the client port does: a length-prefixed binary frame.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut stream, _) = listener.accept().unwrap();
        // The whole request first: a socket closed with bytes unread resets the
        // connection, and the client's write could fail before it reads the answer.
        let mut head = Vec::new();
        let mut byte = [0; 1];
        while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap() == 1 {
            head.push(byte[0]);
        }
        stream.write_all(b"7\0\0\0\x03\0\x01\0\x06frame").unwrap();
    });
    let output = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["forget", "2", "--http"])
        .arg(addr.to_string())
        .output()
        .unwrap();
    server.join().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{output:?}");
    assert!(
        stderr.contains("answered with something other than HTTP"),
        "{stderr}"
    );
    assert!(!stderr.contains('\0'), "{stderr:?}");
}

//! `tally`: the command-line tool. Subcommands arrive with the daemon (issue 4).
fn main() {
    println!("tally {}", env!("CARGO_PKG_VERSION"));
}

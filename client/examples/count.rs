//! Counts one login for `user-42`, checks the `login` rule, and reads the count back.
//!
//! ```text
//! cargo run -p tally-client --example count -- [endpoint]
//! ```
//!
//! The endpoint is `ip:port` or `unix:/path/to.sock`; it defaults to `127.0.0.1:7100`.

use std::error::Error as _;
use std::process::ExitCode;

use tally_client::{Client, Endpoint, Error, Options};

const RULE: &str = "login";
const SUBJECT: &str = "user-42";

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let text = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7100".to_string());
    let endpoint: Endpoint = match text.parse() {
        Ok(endpoint) => endpoint,
        Err(err) => {
            eprintln!("count: {err}");
            return ExitCode::FAILURE;
        }
    };
    match count(endpoint).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let mut message = format!("count: {err}");
            let mut source = err.source();
            while let Some(cause) = source {
                message.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            let retry = if err.is_retryable() {
                " (retryable)"
            } else {
                ""
            };
            eprintln!("{message}{retry}");
            ExitCode::FAILURE
        }
    }
}

async fn count(endpoint: Endpoint) -> Result<(), Error> {
    let client = Client::connect(endpoint, Options::default()).await?;

    let counted = client.incr(RULE, SUBJECT, 1).await?;
    println!(
        "incr  {RULE}/{SUBJECT}: estimate {} in window {} (staleness {} ms)",
        counted.estimate, counted.window, counted.staleness_ms
    );

    let decision = client.check(RULE, SUBJECT, 1).await?;
    println!(
        "check {RULE}/{SUBJECT}: {} at {}/{} ({} remaining, resets in {} ms, {}, bound {:.1})",
        if decision.allowed {
            "allowed"
        } else {
            "denied"
        },
        decision.estimate,
        decision.limit,
        decision.remaining,
        decision.reset_after_ms,
        decision.mode.as_str(),
        decision.bound
    );

    let estimate = client.get(RULE, SUBJECT).await?;
    println!(
        "get   {RULE}/{SUBJECT}: estimate {} in window {} (staleness {} ms)",
        estimate.estimate, estimate.window, estimate.staleness_ms
    );
    Ok(())
}

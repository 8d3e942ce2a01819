//! Requests sent together.

use crate::wire::{CheckId, OpRef};

/// Requests to send together on a client's connection: queued together (usually one write), and
/// answered together by [`Client::send`](crate::Client::send).
///
/// Concurrent calls on one [`Client`](crate::Client) are pipelined anyway. A `Pipeline`
/// does it for one caller, as when one application request consults several rules: its
/// requests share one wait, so the caller's task is woken once per read of answers rather
/// than once per request. Each request still gets its own answer, in order.
///
/// ```
/// use tally_client::Pipeline;
///
/// let mut pipeline = Pipeline::new();
/// pipeline.check("per-ip", "203.0.113.9", 1).check("per-user", "user-42", 1);
/// assert_eq!(pipeline.len(), 2);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Pipeline<'a> {
    ops: Vec<OpRef<'a>>,
}

impl<'a> Pipeline<'a> {
    /// An empty pipeline.
    pub fn new() -> Self {
        Pipeline::default()
    }

    /// Adds an increment, as [`Client::incr`](crate::Client::incr).
    pub fn incr(&mut self, rule: &'a str, subject: &'a str, amount: u64) -> &mut Self {
        self.push(OpRef::Incr {
            rule,
            subject,
            amount,
            id: None,
        })
    }

    /// Adds an increment under `id`, as
    /// [`Client::incr_with_id`](crate::Client::incr_with_id).
    pub fn incr_with_id(
        &mut self,
        id: CheckId,
        rule: &'a str,
        subject: &'a str,
        amount: u64,
    ) -> &mut Self {
        self.push(OpRef::Incr {
            rule,
            subject,
            amount,
            id: Some(id),
        })
    }

    /// Adds a decrement, as [`Client::decr`](crate::Client::decr).
    pub fn decr(&mut self, rule: &'a str, subject: &'a str, amount: u64) -> &mut Self {
        self.push(OpRef::Decr {
            rule,
            subject,
            amount,
            id: None,
        })
    }

    /// Adds a decrement under `id`, as
    /// [`Client::decr_with_id`](crate::Client::decr_with_id).
    pub fn decr_with_id(
        &mut self,
        id: CheckId,
        rule: &'a str,
        subject: &'a str,
        amount: u64,
    ) -> &mut Self {
        self.push(OpRef::Decr {
            rule,
            subject,
            amount,
            id: Some(id),
        })
    }

    /// Adds a read, as [`Client::get`](crate::Client::get).
    pub fn get(&mut self, rule: &'a str, subject: &'a str) -> &mut Self {
        self.push(OpRef::Get { rule, subject })
    }

    /// Adds a check, as [`Client::check`](crate::Client::check).
    pub fn check(&mut self, rule: &'a str, subject: &'a str, cost: u64) -> &mut Self {
        self.push(OpRef::Check {
            rule,
            subject,
            cost,
            id: None,
        })
    }

    /// Adds a check under `id`, as [`Client::check_with_id`](crate::Client::check_with_id).
    pub fn check_with_id(
        &mut self,
        id: CheckId,
        rule: &'a str,
        subject: &'a str,
        cost: u64,
    ) -> &mut Self {
        self.push(OpRef::Check {
            rule,
            subject,
            cost,
            id: Some(id),
        })
    }

    /// How many requests it holds.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether it holds no request.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Removes every request, keeping the room for the next ones.
    pub fn clear(&mut self) {
        self.ops.clear();
    }

    pub(crate) fn ops(&self) -> &[OpRef<'a>] {
        &self.ops
    }

    fn push(&mut self, op: OpRef<'a>) -> &mut Self {
        self.ops.push(op);
        self
    }
}

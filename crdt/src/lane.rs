//! One replica's increments and decrements of one counter.

use serde::{Deserialize, Serialize};

/// One replica's running totals for one counter.
///
/// Invariant: both totals only grow. A merge takes the larger of each, so merging is
/// commutative, associative and idempotent, and a lane never goes back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Lane {
    /// Everything this replica ever added.
    pub incr: u64,
    /// Everything this replica ever subtracted, as a positive total.
    pub decr: u64,
}

/// A write that would take a lane past `u64::MAX`. Lanes never wrap: the write is refused
/// whole and the lane is unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lane overflow: {field} total {total} cannot take {amount} more (max {max})", max = u64::MAX)]
pub struct Overflow {
    /// Which total would overflow: `"incr"` or `"decr"`.
    pub field: &'static str,
    /// The total before the write.
    pub total: u64,
    /// The amount that was refused.
    pub amount: u64,
}

impl Lane {
    /// A lane with the given totals.
    pub fn new(incr: u64, decr: u64) -> Lane {
        Lane { incr, decr }
    }

    /// This lane's contribution to the counter: `incr - decr`, exact in `i128`.
    pub fn value(&self) -> i128 {
        i128::from(self.incr) - i128::from(self.decr)
    }

    /// Adds `amount` to the increments. On overflow the lane is unchanged.
    pub fn incr(&mut self, amount: u64) -> Result<(), Overflow> {
        self.incr = self.incr.checked_add(amount).ok_or(Overflow {
            field: "incr",
            total: self.incr,
            amount,
        })?;
        Ok(())
    }

    /// Adds `amount` to the decrements. On overflow the lane is unchanged.
    pub fn decr(&mut self, amount: u64) -> Result<(), Overflow> {
        self.decr = self.decr.checked_add(amount).ok_or(Overflow {
            field: "decr",
            total: self.decr,
            amount,
        })?;
        Ok(())
    }

    /// Takes the larger of each total. Total: never fails.
    pub fn merge(&mut self, other: Lane) {
        self.incr = self.incr.max(other.incr);
        self.decr = self.decr.max(other.decr);
    }

    /// Whether `self` holds everything `other` holds.
    pub fn covers(&self, other: Lane) -> bool {
        self.incr >= other.incr && self.decr >= other.decr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_is_refused_and_leaves_the_lane_unchanged() {
        let mut lane = Lane::new(u64::MAX - 1, 7);
        assert_eq!(lane.incr(1), Ok(()));
        let err = lane.incr(1).unwrap_err();
        assert_eq!(err.field, "incr");
        assert_eq!(err.total, u64::MAX);
        assert_eq!(lane, Lane::new(u64::MAX, 7));
        assert!(err.to_string().contains("incr total 18446744073709551615"));
    }

    /// TESTING.md C2 for the decrements too: a lane's `decr` total never wraps either.
    #[test]
    fn overflowing_decrement_is_refused_and_leaves_the_lane_unchanged() {
        let mut lane = Lane::new(7, u64::MAX - 1);
        assert_eq!(lane.decr(1), Ok(()));
        let err = lane.decr(2).unwrap_err();
        assert_eq!(
            err,
            Overflow {
                field: "decr",
                total: u64::MAX,
                amount: 2
            }
        );
        assert_eq!(lane, Lane::new(7, u64::MAX));
        assert_eq!(lane.value(), 7 - i128::from(u64::MAX));
    }

    #[test]
    fn value_is_exact_at_the_extremes() {
        assert_eq!(Lane::new(u64::MAX, 0).value(), i128::from(u64::MAX));
        assert_eq!(Lane::new(0, u64::MAX).value(), -i128::from(u64::MAX));
    }
}

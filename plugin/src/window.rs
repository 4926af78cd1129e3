//! How far back an endpoint's stamps reach into its server's LRU: the window of the shared
//! index (see `store`), computed from where re-stamps left dead positions.
//!
//! Every block recorded on an endpoint takes the next position of its clock (its stamp). The
//! server's LRU holds the `capacity` blocks used most recently, so a block is held while
//! fewer than `capacity` *other live* blocks were stamped after it. A position is live while it
//! is its block's newest stamp; a re-stamp (a hot prefix refreshed) kills the block's old
//! position. The window is the age at which the live positions behind the clock reach
//! `capacity`: `capacity` plus the dead positions inside it.
//!
//! Where the dead positions lie matters. A hot prefix is re-stamped only once it has aged
//! (`capacity / 4`), so its dead positions sit far back, among blocks the server evicts first.
//! Spreading the re-stamps evenly over the whole history (the window widened by the share of
//! re-stamps among all stamps) over-counts dead positions near the clock and believes blocks
//! the server evicted long ago: on multi-turn conversations through a full cache that kept
//! routing turns to histories that were gone. [`DeadStamps`] instead counts dead positions per
//! epoch of the clock, over the last [`EPOCHS`] epochs, each at least `capacity / 4` long.

/// Epochs remembered: with epochs of at least `capacity / 4` positions, at least 4 ×
/// `capacity` positions, beyond which the window never reaches.
pub const EPOCHS: usize = 16;
/// The window is at most this many times the capacity (a belief that old is not worth it).
pub const MAX_WIDENING: u64 = 4;

/// Dead positions per epoch of the clock. Epoch `e` covers positions `e << shift ..
/// (e + 1) << shift` and lives in slot `e % EPOCHS`; the slots hold the epochs up to the one
/// of the clock they were last advanced to (older epochs are zeroed as the clock moves on).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeadStamps {
    pub shift: u8,
    pub counts: [u16; EPOCHS],
}

/// The epoch length (as a shift) for a capacity: the smallest power of two with `EPOCHS`
/// epochs spanning at least `MAX_WIDENING × capacity` positions.
pub fn epoch_shift(capacity: u64) -> u8 {
    let span = capacity.max(1).saturating_mul(MAX_WIDENING);
    let epoch = span.div_ceil(EPOCHS as u64).max(1);
    (64 - (epoch - 1).leading_zeros()).min(62) as u8
}

impl DeadStamps {
    fn epoch(&self, position: u64) -> u64 {
        position >> self.shift
    }

    fn slot(&self, epoch: u64) -> usize {
        (epoch % EPOCHS as u64) as usize
    }

    /// Re-bins the counts for `capacity`'s epoch length, at `clock`. Merging epochs is exact;
    /// splitting one spreads its count evenly.
    pub fn fit(&mut self, capacity: u64, clock: u64) {
        let shift = epoch_shift(capacity);
        if shift == self.shift {
            return;
        }
        let old = *self;
        let mut next = DeadStamps {
            shift,
            counts: [0; EPOCHS],
        };
        let newest = old.epoch(clock);
        for age in 0..EPOCHS as u64 {
            let Some(e) = newest.checked_sub(age) else {
                break;
            };
            let count = u64::from(old.counts[old.slot(e)]);
            if count == 0 {
                continue;
            }
            let (first, last) = (e << old.shift, ((e + 1) << old.shift) - 1);
            let (a, b) = (next.epoch(first), next.epoch(last));
            let parts = b - a + 1;
            for (k, target) in (a..=b).enumerate() {
                // Only epochs the new ring still holds (no older than its EPOCHS at `clock`).
                if next.epoch(clock).saturating_sub(target) >= EPOCHS as u64 {
                    continue;
                }
                let share = count / parts + u64::from((k as u64) < count % parts);
                let slot = next.slot(target);
                next.counts[slot] = next.counts[slot].saturating_add(share as u16);
            }
        }
        *self = next;
    }

    /// The clock moved from `from` to `to`: zero the slots of the epochs it entered.
    pub fn advance(&mut self, from: u64, to: u64) {
        let (old, new) = (self.epoch(from), self.epoch(to));
        if new <= old {
            return;
        }
        for e in (old + 1..=new).take(EPOCHS) {
            let slot = self.slot(e);
            self.counts[slot] = 0;
        }
    }

    /// A block's stamp `stamp` stopped being its newest (it was re-stamped) while the clock is
    /// at `clock`. Positions older than the ring are not tracked (the window never reaches
    /// them).
    pub fn kill(&mut self, stamp: u64, clock: u64) {
        self.kill_many(stamp, 1, clock);
    }

    /// [`Self::kill`] for a recorded block that stood for `count` positions (counted in its
    /// stamp's epoch).
    pub fn kill_many(&mut self, stamp: u64, count: u64, clock: u64) {
        let (e, newest) = (self.epoch(stamp), self.epoch(clock));
        if e > newest || newest - e >= EPOCHS as u64 {
            return;
        }
        let slot = self.slot(e);
        let count = u16::try_from(count).unwrap_or(u16::MAX);
        self.counts[slot] = self.counts[slot].saturating_add(count);
    }

    /// The window at `clock`: the age at which the live positions reach `capacity`, never
    /// back past the last emptying of the belief (`window_start`, a restart: positions before
    /// it are gone), between `capacity` and [`MAX_WIDENING`] × `capacity`.
    pub fn window(&self, clock: u64, window_start: u64, capacity: u64) -> u64 {
        let capacity = capacity.max(1);
        let max = capacity.saturating_mul(MAX_WIDENING);
        let floor = window_start.saturating_add(1);
        let (mut positions, mut live) = (0u64, 0u64);
        let newest = self.epoch(clock);
        for age in 0..EPOCHS as u64 {
            let Some(e) = newest.checked_sub(age) else {
                break;
            };
            let first = (e << self.shift).max(floor);
            let last = (((e + 1) << self.shift) - 1).min(clock);
            if first > last {
                break;
            }
            let in_epoch = last - first + 1;
            let dead = u64::from(self.counts[self.slot(e)]).min(in_epoch);
            let alive = in_epoch - dead;
            if live + alive >= capacity {
                // Inside this epoch: assume its dead positions are spread evenly.
                let needed = (capacity - live) as u128 * in_epoch as u128 / alive.max(1) as u128;
                positions += needed as u64;
                return positions.clamp(capacity, max);
            }
            positions += in_epoch;
            live += alive;
            if first == floor {
                break;
            }
        }
        // Fewer live positions than the capacity in the ring (or since the restart): older
        // positions have no dead ones we know of.
        (positions + (capacity - live)).clamp(capacity, max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_dead_positions_the_window_is_the_capacity() {
        let d = DeadStamps {
            shift: epoch_shift(100),
            ..Default::default()
        };
        assert_eq!(d.window(1000, 0, 100), 100);
        assert_eq!(d.window(10, 0, 100), 100);
    }

    #[test]
    fn dead_positions_near_the_clock_widen_the_window_by_their_count() {
        let mut d = DeadStamps::default();
        d.fit(100, 1000);
        assert_eq!(1 << d.shift, 32, "16 epochs of 32 cover 4 × 100");
        for stamp in 990..1000 {
            d.kill(stamp, 1000);
        }
        // 10 of the newest positions are dead: 110 positions hold 100 live ones.
        assert_eq!(d.window(1000, 0, 100), 110);
    }

    #[test]
    fn dead_positions_beyond_the_window_do_not_widen_it() {
        let mut d = DeadStamps::default();
        d.fit(100, 1000);
        // Re-stamps of old blocks: their dead positions lie ~300 back, past the 100 newest
        // live positions, so the LRU boundary does not move.
        for stamp in 690..740 {
            d.kill(stamp, 1000);
        }
        assert_eq!(d.window(1000, 0, 100), 100);
    }

    #[test]
    fn the_window_is_bounded_and_never_reaches_behind_a_restart() {
        let mut d = DeadStamps::default();
        d.fit(100, 2000);
        for stamp in 1600..2000 {
            d.kill(stamp, 2000);
        }
        assert_eq!(d.window(2000, 0, 100), 400, "at most 4 × the capacity");
        let mut fresh = DeadStamps::default();
        fresh.fit(100, 1050);
        for stamp in 1001..1050 {
            fresh.kill(stamp, 1050);
        }
        assert_eq!(fresh.window(1050, 1000, 100), 100 + 49);
    }

    #[test]
    fn advancing_the_clock_forgets_the_epochs_it_leaves_behind() {
        let mut d = DeadStamps::default();
        d.fit(100, 100);
        d.kill(90, 100);
        assert_eq!(d.counts.iter().map(|&c| u32::from(c)).sum::<u32>(), 1);
        d.advance(100, 100 + 32 * EPOCHS as u64);
        assert_eq!(d.counts, [0; EPOCHS], "the whole ring turned over");
        d.kill(5, 100 + 32 * EPOCHS as u64);
        assert_eq!(d.counts, [0; EPOCHS], "too old to track");
    }

    #[test]
    fn refitting_to_a_new_capacity_keeps_the_dead_count() {
        let mut d = DeadStamps::default();
        d.fit(100, 1000);
        for stamp in 900..1000 {
            d.kill(stamp, 1000);
        }
        let total = |d: &DeadStamps| d.counts.iter().map(|&c| u32::from(c)).sum::<u32>();
        d.fit(400, 1000);
        assert_eq!(total(&d), 100, "merged into longer epochs");
        d.fit(100, 1000);
        assert_eq!(total(&d), 100, "split back");
        // The 100 dead positions really were the newest; split evenly, some of them land past
        // the clock and are lost, so the window comes out a little short of 200.
        assert!((180..=200).contains(&d.window(1000, 0, 100)));
    }
}

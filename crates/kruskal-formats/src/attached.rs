//! A slot on a tensor for a resource tied to where its arrays lie.

use std::any::Any;
use std::sync::Mutex;

/// What a [`crate::SparseTensor`] may keep for another crate: a resource
/// tied to the addresses of its arrays, kept as long as the tensor and
/// dropped before its arrays are freed or replaced. The device crate keeps
/// the arrays' page-lock registration here, so a second upload of the same
/// tensor copies at the bus's pinned speed and the unlocking happens when
/// the tensor goes, not during a build.
///
/// A clone of the tensor starts empty (its arrays lie elsewhere), and the
/// slot takes no part in equality.
#[derive(Default)]
pub struct Attached(Mutex<Option<Box<dyn Any + Send>>>);

/// The slot's content: `None`, or a resource of a type the holder knows.
pub type AttachedSlot = Option<Box<dyn Any + Send>>;

impl Attached {
    /// Runs `f` on the slot, holding it for the call (a second caller
    /// waits). A panic of an earlier holder leaves the slot usable.
    pub fn with<R>(&self, f: impl FnOnce(&mut AttachedSlot) -> R) -> R {
        let mut slot = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut slot)
    }

    /// Drops what the slot holds, before the arrays it concerns change.
    pub(crate) fn clear(&mut self) {
        *self
            .0
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }

    fn is_set(&self) -> bool {
        self.with(|slot| slot.is_some())
    }
}

impl Clone for Attached {
    fn clone(&self) -> Self {
        Attached::default()
    }
}

impl PartialEq for Attached {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_set() {
            "Attached(set)"
        } else {
            "Attached(empty)"
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::SparseTensor;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts its drops.
    struct Witness(Arc<AtomicUsize>);
    impl Drop for Witness {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn tensor() -> SparseTensor {
        SparseTensor::new(
            vec![3, 2],
            vec![vec![2, 0, 1], vec![1, 1, 0]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap()
    }

    #[test]
    fn a_clone_starts_empty_and_equality_ignores_the_slot() {
        let t = tensor();
        let drops = Arc::new(AtomicUsize::new(0));
        t.attached()
            .with(|slot| *slot = Some(Box::new(Witness(drops.clone()))));
        let c = t.clone();
        assert!(c.attached().with(|slot| slot.is_none()));
        assert!(t.attached().with(|slot| slot.is_some()));
        assert_eq!(c, t);
        assert_eq!(format!("{:?}", t.attached()), "Attached(set)");
        drop(c);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_slot_is_dropped_with_the_tensor_and_before_a_reorder() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mut t = tensor();
        t.attached()
            .with(|slot| *slot = Some(Box::new(Witness(drops.clone()))));
        t.sort_by_modes(&[0, 1]).unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert!(t.attached().with(|slot| slot.is_none()));
        assert_eq!(t.mode_indices(0), &[0, 1, 2]);

        t.attached()
            .with(|slot| *slot = Some(Box::new(Witness(drops.clone()))));
        let (_, indices, _) = t.into_parts();
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        assert_eq!(indices[1], vec![1, 0, 1]);

        let t = tensor();
        t.attached()
            .with(|slot| *slot = Some(Box::new(Witness(drops.clone()))));
        drop(t);
        assert_eq!(drops.load(Ordering::SeqCst), 3);
    }
}

//! What a writer made of each frame of a profile's table.

use super::{FrameId, FrameTable};

/// What a writer made of each frame of one table (its location in the output), by frame id: a
/// frame met in many stacks is looked up once, not once per stack. Ids beyond the table it was
/// sized for are never remembered.
#[derive(Clone, Debug, Default)]
pub struct PerFrame<T> {
    made: Vec<Option<T>>,
}

impl<T: Copy> PerFrame<T> {
    pub fn for_table(frames: &FrameTable) -> Self {
        PerFrame { made: vec![None; frames.len()] }
    }

    pub fn get(&self, id: FrameId) -> Option<T> {
        self.made.get(id as usize).copied().flatten()
    }

    pub fn remember(&mut self, id: FrameId, made: T) {
        if let Some(slot) = self.made.get_mut(id as usize) {
            *slot = Some(made);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stack::tests::python;

    #[test]
    fn per_frame_remembers_what_was_made_of_each_frame_of_its_table_only() {
        let mut table = FrameTable::default();
        let (first, second) = (table.intern(python(4)), table.intern(python(5)));
        let mut locations = PerFrame::for_table(&table);
        assert_eq!((locations.get(first), locations.get(second)), (None, None));
        locations.remember(second, 7u64);
        assert_eq!((locations.get(first), locations.get(second)), (None, Some(7)));
        // A frame interned after the writer started is not the writer's to remember.
        let later = table.intern(python(6));
        locations.remember(later, 9);
        assert_eq!(locations.get(later), None);
    }
}

//! Token-id lists read element by element: counted against the limits, never kept past them.

use super::{IdsAre, State};
use crate::error::ApiError;
use serde::de::{self, DeserializeSeed, IgnoredAny, SeqAccess, Visitor};
use std::fmt;

/// A list of token ids, counted as it is read: past `max_ids` the rest is only counted (for an
/// exact length in the error), never kept.
pub(super) struct IdsSeed<'s, 'a> {
    pub(super) st: &'s mut State<'a>,
    pub(super) path: String,
    /// An id already read (the first of a single list, read to learn the shape).
    pub(super) first: Option<u32>,
}

impl<'de> DeserializeSeed<'de> for IdsSeed<'_, '_> {
    type Value = Vec<u32>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Vec<u32>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> IdsSeed<'_, '_> {
    pub(super) fn visit_rest<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u32>, A::Error> {
        let (st, path) = (self.st, self.path);
        let max = st.adm.max_ids;
        let mut ids: Vec<u32> = self.first.into_iter().collect();
        loop {
            if ids.len() >= max {
                let mut n = ids.len();
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                if n > max {
                    let e = match st.adm.ids_are {
                        IdsAre::Sequence => ApiError::invalid(
                            path.clone(),
                            format!("sequence of {n} tokens exceeds max-seq-len {max}"),
                        ),
                        IdsAre::Candidates => ApiError::invalid(
                            path.clone(),
                            format!("{n} candidate ids exceed the server's max-k {max}"),
                        ),
                        IdsAre::Detokenize => ApiError::InputTooLarge {
                            field: path.clone(),
                            message: format!("{n} token ids exceed --max-queue-tokens {max}"),
                        },
                    };
                    return Err(st.fail(e));
                }
                return Ok(ids);
            }
            let j = ids.len();
            let v: Option<IdOrNot> = seq.next_element()?;
            match v {
                None => return Ok(ids),
                Some(IdOrNot::Id(id)) => {
                    st.count_ids::<A::Error>(&path, 1)?;
                    ids.push(id);
                }
                Some(IdOrNot::Not(shown)) => {
                    return Err(st.fail(ApiError::invalid(
                        format!("{path}[{j}]"),
                        format!("{shown} is not a token id"),
                    )))
                }
            }
        }
    }
}

impl<'de> Visitor<'de> for IdsSeed<'_, '_> {
    type Value = Vec<u32>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of token ids")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Vec<u32>, A::Error> {
        self.visit_rest(seq)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Vec<u32>, E> {
        Err(self.wrong())
    }
    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Vec<u32>, A::Error> {
        Err(self.wrong())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Vec<u32>, E> {
        Err(self.wrong())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Vec<u32>, E> {
        Err(self.wrong())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Vec<u32>, E> {
        Err(self.wrong())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Vec<u32>, E> {
        Err(self.wrong())
    }
    fn visit_unit<E: de::Error>(self) -> Result<Vec<u32>, E> {
        Err(self.wrong())
    }
}

impl IdsSeed<'_, '_> {
    fn wrong<E: de::Error>(self) -> E {
        self.st.fail(ApiError::invalid(
            self.path,
            "expected a list of token ids like the other items",
        ))
    }
}

/// One element of an id list: an id, or what it was instead (for the error).
enum IdOrNot {
    Id(u32),
    Not(String),
}

impl<'de> de::Deserialize<'de> for IdOrNot {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<IdOrNot, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IdOrNot;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<IdOrNot, E> {
                Ok(u32::try_from(v).map_or_else(|_| IdOrNot::Not(v.to_string()), IdOrNot::Id))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<IdOrNot, E> {
                Ok(u64::try_from(v).map_or_else(
                    |_| IdOrNot::Not(v.to_string()),
                    |u| u32::try_from(u).map_or_else(|_| IdOrNot::Not(v.to_string()), IdOrNot::Id),
                ))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<IdOrNot, E> {
                Ok(IdOrNot::Not(v.to_string()))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<IdOrNot, E> {
                Ok(IdOrNot::Not("a string".into()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<IdOrNot, E> {
                Ok(IdOrNot::Not(v.to_string()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<IdOrNot, E> {
                Ok(IdOrNot::Not("null".into()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<IdOrNot, A::Error> {
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(IdOrNot::Not("a list".into()))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut m: A) -> Result<IdOrNot, A::Error> {
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(IdOrNot::Not("an object".into()))
            }
        }
        d.deserialize_any(V)
    }
}

//! The registry pattern every family of this crate shares: one line per entry binds a variant to
//! its config name (plus aliases), its implementation and a one-line meaning. The enum keeps
//! call sites typed (`KlEstimator::K3`) while the names come from the same line.

/// A name from a config that matches no registered entry.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("unknown {what} `{name}`; expected one of: {}", .valid.join(", "))]
pub struct UnknownName {
    pub what: &'static str,
    pub name: String,
    pub valid: Vec<&'static str>,
}

/// What every registry offers to the config: its entries' names and meanings, and lookup.
pub trait Registered: Sized + Copy + 'static {
    /// What an entry is, for messages ("KL estimator").
    const WHAT: &'static str;
    /// Every entry, in registry order.
    const ALL: &'static [Self];
    /// The entry's config name.
    fn name(self) -> &'static str;
    /// Further names the config accepts for the same entry.
    fn aliases(self) -> &'static [&'static str];
    /// One line on what the entry computes.
    fn meaning(self) -> &'static str;

    /// Every accepted name (each entry's name, then its aliases), in registry order.
    fn names() -> Vec<&'static str> {
        Self::ALL
            .iter()
            .flat_map(|e| std::iter::once(e.name()).chain(e.aliases().iter().copied()))
            .collect()
    }

    /// The entry `name` stands for.
    fn from_name(name: &str) -> Result<Self, UnknownName> {
        Self::ALL
            .iter()
            .copied()
            .find(|e| e.name() == name || e.aliases().contains(&name))
            .ok_or_else(|| UnknownName {
                what: Self::WHAT,
                name: name.to_string(),
                valid: Self::names(),
            })
    }
}

/// Declares a registry enum. Each line is
/// `Variant = "name" | "alias" ... => implementation, "meaning";`
/// where the implementation is any constant of the declared type (usually a `fn`). The enum gets
/// [`Registered`], inherent `from_name`/`names` (so callers need no trait import), and a private
/// `implementation()` that the family's dispatch function calls.
macro_rules! registry {
    (
        $(#[$attr:meta])*
        $vis:vis enum $Enum:ident: $what:literal => $Impl:ty {
            $( $Variant:ident = $name:literal $(| $alias:literal)* => $implementation:expr, $meaning:literal; )+
        }
    ) => {
        $(#[$attr])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis enum $Enum {
            $( #[doc = $meaning] $Variant, )+
        }

        impl $crate::registry::Registered for $Enum {
            const WHAT: &'static str = $what;
            const ALL: &'static [Self] = &[$($Enum::$Variant),+];
            fn name(self) -> &'static str {
                match self { $($Enum::$Variant => $name,)+ }
            }
            fn aliases(self) -> &'static [&'static str] {
                match self { $($Enum::$Variant => &[$($alias),*],)+ }
            }
            fn meaning(self) -> &'static str {
                match self { $($Enum::$Variant => $meaning,)+ }
            }
        }

        impl $Enum {
            pub fn from_name(name: &str) -> ::std::result::Result<Self, $crate::registry::UnknownName> {
                <Self as $crate::registry::Registered>::from_name(name)
            }

            /// Every name the config accepts, aliases included.
            pub fn names() -> Vec<&'static str> {
                <Self as $crate::registry::Registered>::names()
            }

            fn implementation(self) -> $Impl {
                match self { $($Enum::$Variant => $implementation,)+ }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn double(x: i32) -> i32 {
        2 * x
    }
    fn negate(x: i32) -> i32 {
        -x
    }

    registry! {
        enum Op: "operation" => fn(i32) -> i32 {
            Double = "double" | "twice" => double, "2x";
            Negate = "negate" => negate, "-x";
        }
    }

    #[test]
    fn names_aliases_and_lookup_come_from_one_line() {
        assert_eq!(Op::names(), ["double", "twice", "negate"]);
        assert_eq!(Op::from_name("twice").unwrap(), Op::Double);
        assert_eq!((Op::Negate.implementation())(3), -3);
        assert_eq!(Op::Double.meaning(), "2x");
        let e = Op::from_name("halve").unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown operation `halve`; expected one of: double, twice, negate"
        );
    }
}

//! c10::ScalarType codes for the kinds we exchange in metadata (shape checks, bucket reference).
use tch::Kind;

const TABLE: &[(Kind, i32)] = &[
    (Kind::Uint8, 0),
    (Kind::Int8, 1),
    (Kind::Int16, 2),
    (Kind::Int, 3),
    (Kind::Int64, 4),
    (Kind::Half, 5),
    (Kind::Float, 6),
    (Kind::Double, 7),
    (Kind::ComplexFloat, 9),
    (Kind::ComplexDouble, 10),
    (Kind::Bool, 11),
    (Kind::BFloat16, 15),
];

pub(crate) fn code(k: Kind) -> Option<i32> {
    TABLE.iter().find(|(kk, _)| *kk == k).map(|(_, c)| *c)
}

pub(crate) fn from_code(c: i64) -> Option<Kind> {
    TABLE.iter().find(|(_, cc)| *cc as i64 == c).map(|(k, _)| *k)
}

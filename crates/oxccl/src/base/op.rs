//! Reduction operations.

use std::fmt;
use std::str::FromStr;

use crate::base::dtype::DataType;

/// How values from different ranks are combined.
///
/// On [`DataType::Bool`] the arithmetic ops are logical, as in gloo and NCCL: `Sum` and `Max`
/// are *or*, `Prod` and `Min` are *and*, and `Avg` is an error.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum ReduceOp {
    /// Sum (integers wrap on overflow, as in NCCL).
    Sum,
    /// Product (integers wrap on overflow).
    Prod,
    /// Minimum (for floats NaN handling follows `f32::min`).
    Min,
    /// Maximum.
    Max,
    /// Average, as NCCL's `ncclAvg`: the sum divided by the number of ranks
    /// (integer division, truncating, for integer types).
    Avg,
    /// Bitwise and (integers and bool only).
    BAnd,
    /// Bitwise or (integers and bool only).
    BOr,
    /// Bitwise exclusive or (integers and bool only).
    BXor,
    /// NCCL's `ncclRedOpCreatePreMulSum`: every rank's input multiplied by its scalar, then
    /// summed. Ranks may pass different scalars. Floats (f16 and bf16 through f32) multiply in
    /// their type; for integer types and bool the scalar must be an integer (integers wrap, a
    /// bool stays true unless the scalar is 0).
    PreMulSum(f64),
}

impl ReduceOp {
    /// The arithmetic ops, valid on every numeric type, in NCCL's order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The bitwise ops, valid on integer types and bool.
    pub const BITWISE: [ReduceOp; 3] = [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor];

    /// The name nccl-tests prints (`premul_sum` without its scalar).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
            ReduceOp::PreMulSum(_) => "premul_sum",
        }
    }

    /// The op's code on the wire (call fingerprints): its kind, not a premul_sum's scalar
    /// (which may differ between ranks).
    pub const fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Avg => 4,
            ReduceOp::BAnd => 5,
            ReduceOp::BOr => 6,
            ReduceOp::BXor => 7,
            ReduceOp::PreMulSum(_) => 8,
        }
    }

    /// The op of a wire [`code`](Self::code) (a premul_sum with scalar 1).
    pub const fn from_code(code: u8) -> Option<ReduceOp> {
        Some(match code {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Prod,
            2 => ReduceOp::Max,
            3 => ReduceOp::Min,
            4 => ReduceOp::Avg,
            5 => ReduceOp::BAnd,
            6 => ReduceOp::BOr,
            7 => ReduceOp::BXor,
            8 => ReduceOp::PreMulSum(1.0),
            _ => return None,
        })
    }

    /// The op the reduction kernels run: a premul_sum sums (its inputs are scaled before).
    pub const fn kernel(self) -> ReduceOp {
        match self {
            ReduceOp::PreMulSum(_) => ReduceOp::Sum,
            op => op,
        }
    }

    /// Whether the op is defined on `dtype`; the error says why not.
    pub fn check(self, dtype: DataType) -> Result<(), String> {
        let integral = !dtype.is_float();
        match self {
            ReduceOp::Avg if dtype == DataType::Bool => {
                Err("avg is not defined on bool (use sum for a logical or)".into())
            }
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor if !integral => Err(format!(
                "{} is a bitwise op: integer types and bool only, not {dtype}",
                self.name()
            )),
            ReduceOp::PreMulSum(s) if !s.is_finite() => {
                Err(format!("premul_sum scalar {s} is not finite"))
            }
            ReduceOp::PreMulSum(s) if integral && (s.fract() != 0.0 || s.abs() >= 9.2e18) => Err(
                format!("premul_sum on {dtype} needs an integer scalar, got {s}"),
            ),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for ReduceOp {
    /// The name; a premul_sum as `premul_sum:SCALAR` (what [`FromStr`] reads).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::PreMulSum(s) => write!(f, "premul_sum:{s}"),
            op => f.write_str(op.name()),
        }
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    /// Accepts the names (and `product`, `mean`, `and`/`or`/`xor`), and `premul_sum:SCALAR`.
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        if let Some(scalar) = lower.strip_prefix("premul_sum:") {
            return scalar
                .trim()
                .parse::<f64>()
                .map(ReduceOp::PreMulSum)
                .map_err(|e| {
                    format!(
                        "premul_sum scalar '{}': {e}",
                        crate::base::param::table::shown(scalar)
                    )
                });
        }
        Ok(match lower.as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" => ReduceOp::Avg,
            "band" | "and" => ReduceOp::BAnd,
            "bor" | "or" => ReduceOp::BOr,
            "bxor" | "xor" => ReduceOp::BXor,
            _ => {
                return Err(format!(
                    "unknown reduction op '{}' (expected sum, prod, min, max, avg, band, bor, bxor or premul_sum:SCALAR)",
                    crate::base::param::table::shown(s)
                ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_codes_and_checks() {
        for op in ReduceOp::ALL.into_iter().chain(ReduceOp::BITWISE) {
            assert_eq!(op.to_string().parse::<ReduceOp>().unwrap(), op);
            assert_eq!(ReduceOp::from_code(op.code()), Some(op));
        }
        let p = ReduceOp::PreMulSum(0.25);
        assert_eq!(p.to_string().parse::<ReduceOp>().unwrap(), p);
        assert_eq!(
            ReduceOp::from_code(p.code()).map(|o| o.name()),
            Some("premul_sum")
        );
        assert_eq!(p.kernel(), ReduceOp::Sum);
        assert!(ReduceOp::from_code(9).is_none());
        assert!("premul_sum:x".parse::<ReduceOp>().is_err());
        assert!(ReduceOp::Avg
            .check(DataType::Bool)
            .unwrap_err()
            .contains("bool"));
        assert!(ReduceOp::BXor
            .check(DataType::F32)
            .unwrap_err()
            .contains("bitwise"));
        assert!(ReduceOp::BXor.check(DataType::Bool).is_ok());
        assert!(p
            .check(DataType::I32)
            .unwrap_err()
            .contains("integer scalar"));
        assert!(ReduceOp::PreMulSum(3.0).check(DataType::I32).is_ok());
        assert!(p.check(DataType::Bf16).is_ok());
        assert!(ReduceOp::PreMulSum(f64::NAN).check(DataType::F32).is_err());
    }
}

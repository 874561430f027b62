//! Reduction operations.

use std::fmt;
use std::str::FromStr;

/// How values from different ranks are combined.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
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
}

impl ReduceOp {
    /// Every op, in NCCL's order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The name nccl-tests prints.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" => ReduceOp::Avg,
            _ => {
                return Err(format!(
                    "unknown reduction op '{s}' (expected sum, prod, min, max or avg)"
                ))
            }
        })
    }
}

//! (being written) UltraEP quota planner.
use crate::{BalanceError, Balancer, Layout, LoadMatrix, Plan};
pub const DEFAULT_U_MIN: u64 = 1;
pub struct QuotaPlanner;
impl QuotaPlanner { pub fn new(_u: u64) -> Self { QuotaPlanner } }
impl Balancer for QuotaPlanner {
    fn name(&self) -> &'static str { "quota" }
    fn plan(&mut self, layout: &Layout, load: &LoadMatrix) -> Result<Plan, BalanceError> { Ok(Plan::main_only(layout, &load.expert_totals())) }
}

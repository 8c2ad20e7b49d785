//! (being written) DeepSeek EPLB baselines.
use crate::{BalanceError, Balancer, Layout, LoadMatrix, Plan};
pub const DEFAULT_HISTORY_WINDOW: usize = 50;
pub const DEFAULT_REBALANCE_INTERVAL: usize = 50;
pub struct EplbExact;
impl Balancer for EplbExact {
    fn name(&self) -> &'static str { "eplb-exact" }
    fn plan(&mut self, layout: &Layout, load: &LoadMatrix) -> Result<Plan, BalanceError> { Ok(Plan::main_only(layout, &load.expert_totals())) }
}
pub struct EplbHistory;
impl EplbHistory { pub fn new(_w: usize, _i: usize) -> Self { EplbHistory } }
impl Balancer for EplbHistory {
    fn name(&self) -> &'static str { "eplb-history" }
    fn plan(&mut self, layout: &Layout, load: &LoadMatrix) -> Result<Plan, BalanceError> { Ok(Plan::main_only(layout, &load.expert_totals())) }
}

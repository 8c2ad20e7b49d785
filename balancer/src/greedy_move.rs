//! (being written) FEPLB whole-expert greedy baseline.
use crate::{BalanceError, Balancer, Layout, LoadMatrix, Plan};
pub struct GreedyMove;
impl Balancer for GreedyMove {
    fn name(&self) -> &'static str { "greedy-move" }
    fn plan(&mut self, layout: &Layout, load: &LoadMatrix) -> Result<Plan, BalanceError> { Ok(Plan::main_only(layout, &load.expert_totals())) }
}

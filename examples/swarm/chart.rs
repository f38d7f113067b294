//! The SVG chart: hit rate and time to first token per policy, one group of bars per table.

use std::error::Error;
use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::Table;

/// One colour a policy: the five of every run and `--oracle`'s sixth.
const COLORS: [RGBColor; 6] = [
    RGBColor(0xd6, 0x4f, 0x3e),
    RGBColor(0xe8, 0x9f, 0x2b),
    RGBColor(0x4a, 0x7f, 0xc1),
    RGBColor(0x3a, 0x9a, 0x5b),
    RGBColor(0x1f, 0x5f, 0x3a),
    RGBColor(0x7b, 0x4f, 0xa6),
];

pub(crate) fn draw(path: &Path, title: &str, tables: &[Table]) -> Result<(), Box<dyn Error>> {
    let Some(first) = tables.first() else {
        return Ok(());
    };
    let policies: Vec<&str> = first.rows.iter().map(|r| r.policy).collect();
    let groups = tables.len();
    let width = 520 + 220 * groups as u32;
    let root = SVGBackend::new(path, (width, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    let (left, right) = root.split_horizontally(width / 2);

    let x_range = -0.5f64..(groups as f64 - 0.5);
    let labels: Vec<String> = tables.iter().map(|t| t.label.clone()).collect();
    let x_label = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < groups {
            labels[i as usize].clone()
        } else {
            String::new()
        }
    };
    let bar_width = 0.8 / policies.len() as f64;
    let bar = |g: usize, j: usize| {
        let x0 = g as f64 - 0.4 + j as f64 * bar_width;
        (x0 + 0.05 * bar_width, x0 + 0.95 * bar_width)
    };
    let above = |area: &DrawingArea<SVGBackend<'_>, _>| {
        ("sans-serif", 11)
            .into_font()
            .into_text_style(area)
            .pos(Pos::new(HPos::Center, VPos::Bottom))
    };

    let mut hits = ChartBuilder::on(&left)
        .caption(
            "hit rate: turns reusing >= 80% of the previous context",
            ("sans-serif", 14),
        )
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(x_range.clone(), 0f64..140f64)?;
    hits.configure_mesh()
        .disable_x_mesh()
        .x_labels(20 * groups)
        .x_label_formatter(&x_label)
        .y_label_formatter(&|y| {
            if *y <= 100.0 {
                format!("{y:.0}")
            } else {
                String::new()
            }
        })
        .y_desc("% of turns (compactions excluded)")
        .draw()?;
    for (j, policy) in policies.iter().enumerate() {
        let color = COLORS[j % COLORS.len()];
        let values = hit_rates(tables, policy);
        hits.draw_series(values.iter().map(|&(g, v)| {
            let (x0, x1) = bar(g, j);
            Rectangle::new([(x0, 0.0), (x1, v)], color.filled())
        }))?
        .label(*policy)
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        hits.draw_series(values.iter().map(|&(g, v)| {
            let (x0, x1) = bar(g, j);
            Text::new(format!("{v:.0}"), ((x0 + x1) / 2.0, v + 1.0), above(&left))
        }))?;
    }
    hits.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;

    let max = tables
        .iter()
        .flat_map(|t| t.rows.iter().map(|r| r.p90.as_secs_f64()))
        .fold(1.0f64, f64::max);
    let mut ttft = ChartBuilder::on(&right)
        .caption(
            "time to first token, s (solid: p50, light: p90)",
            ("sans-serif", 14),
        )
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(x_range, (0.1f64..max * 3.0).log_scale())?;
    ttft.configure_mesh()
        .disable_x_mesh()
        .x_labels(20 * groups)
        .x_label_formatter(&x_label)
        .y_label_formatter(&|y| short(*y))
        .y_desc("seconds (log scale)")
        .draw()?;
    for (j, policy) in policies.iter().enumerate() {
        let color = COLORS[j % COLORS.len()];
        let values: Vec<(usize, f64, f64)> = tables
            .iter()
            .enumerate()
            .filter_map(|(g, t)| {
                let r = t.row(policy)?;
                Some((g, r.p50.as_secs_f64(), r.p90.as_secs_f64()))
            })
            .collect();
        ttft.draw_series(values.iter().map(|&(g, _, p90)| {
            let (x0, x1) = bar(g, j);
            Rectangle::new([(x0, 0.1), (x1, p90.max(0.1))], color.mix(0.35).filled())
        }))?;
        ttft.draw_series(values.iter().map(|&(g, p50, _)| {
            let (x0, x1) = bar(g, j);
            Rectangle::new([(x0, 0.1), (x1, p50.max(0.1))], color.filled())
        }))?;
        ttft.draw_series(values.iter().map(|&(g, p50, p90)| {
            let (x0, x1) = bar(g, j);
            Text::new(
                format!("{}/{}", short(p50), short(p90)),
                ((x0 + x1) / 2.0, p90.max(0.1) * 1.08),
                above(&right),
            )
        }))?;
    }
    root.present()?;
    Ok(())
}

/// `policy`'s hit rate in each table, in percent, by the table's index: none where it sent
/// no later turn, for which the table prints `-`.
fn hit_rates(tables: &[Table], policy: &str) -> Vec<(usize, f64)> {
    tables
        .iter()
        .enumerate()
        .filter_map(|(g, t)| {
            let r = t.row(policy).filter(|r| r.eligible > 0)?;
            Some((g, 100.0 * r.hit_rate()))
        })
        .collect()
}

fn short(s: f64) -> String {
    if s < 10.0 {
        format!("{s:.1}")
    } else {
        format!("{s:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Row;
    use crate::sim::Policy;

    #[test]
    fn a_table_without_later_turns_draws_no_hit_rate() {
        let row = |eligible, hits| Row {
            eligible,
            hits,
            ..Row::new("NodeThenBackend", &[])
        };
        let table = |row| Table {
            label: String::new(),
            title: String::new(),
            rows: vec![row],
            ideal: false,
            notes: vec![],
        };
        let tables = [table(row(0, 0)), table(row(4, 3))];
        assert_eq!(hit_rates(&tables, "NodeThenBackend"), [(1, 75.0)]);
        assert_eq!(hit_rates(&tables, "RoundRobin"), []);
    }

    #[test]
    fn every_policy_has_a_colour_of_its_own_with_the_oracle_too() {
        let rows: Vec<Row> = Policy::ALL
            .iter()
            .chain([&Policy::Oracle])
            .map(|p| Row::new(p.name(), &[]))
            .collect();
        let table = Table {
            label: "t".into(),
            title: "t".into(),
            rows,
            ideal: false,
            notes: vec![],
        };
        let dir = std::env::temp_dir().join(format!("swarm-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("chart.svg");
        draw(&path, "t", &[table]).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let mut fills: Vec<&str> = svg
            .split("fill=\"#")
            .skip(1)
            .map(|s| &s[..6])
            .filter(|c| !["000000", "FFFFFF"].contains(c))
            .collect();
        fills.sort_unstable();
        fills.dedup();
        assert_eq!(fills.len(), 6, "{fills:?}");
    }
}

//! The `strftime` directives chat templates use for today's date, in UTC; any other is an
//! error naming it, never a silently wrong date.

/// Renders `format` for `unix_seconds` (UTC).
pub fn format(unix_seconds: i64, format: &str) -> Result<String, String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('%') => out.push('%'),
            Some(other) => return Err(format!("strftime_now: unsupported directive %{other}")),
            None => return Err("strftime_now: format ends with a lone %".to_owned()),
        }
    }
    Ok(out)
}

/// Year, month (1-12) and day of the month of a day count from 1970-01-01 (proleptic
/// Gregorian calendar; Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::format;

    #[test]
    fn dates_render_as_python_strftime_does() {
        // 2026-11-30 21:05:09 UTC, a Monday; 2000-02-29 (leap day); 1970-01-01 (Thursday).
        assert_eq!(
            format(1_796_072_709, "%d %b %Y|%Y-%m-%d|%A %a %B %y|%H:%M:%S|%e%%").unwrap(),
            "30 Nov 2026|2026-11-30|Monday Mon November 26|21:05:09|30%"
        );
        assert_eq!(
            format(951_782_400, "%Y-%m-%d %a").unwrap(),
            "2000-02-29 Tue"
        );
        assert_eq!(
            format(0, "%d %B %Y %A").unwrap(),
            "01 January 1970 Thursday"
        );
        assert!(format(0, "%Q").unwrap_err().contains("%Q"));
    }
}

//! Qwen3-VL's multimodal rotary positions (transformers' `get_rope_index`, qwen3-vl-spec §2.5)
//! and the expansion of each image's single `<|image_pad|>` into its token count.
//!
//! Text tokens advance one position on all three axes (T, H, W). An image's merged tokens share
//! the T position and take their row and column offsets on H and W; the text after it resumes
//! at `start + max(h, w) / merge`, so positions run ahead of token indices by `rope_delta`, which
//! decoding adds to every later position.

use crate::error::{ModelError, Result};

/// The token ids and merge size that position and expansion rules depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionTokens {
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
    pub merge_size: usize,
}

impl VisionTokens {
    /// Merged tokens of an image with grid `(t, h, w)`.
    pub fn tokens_of(&self, grid: [usize; 3]) -> usize {
        grid.iter().product::<usize>() / (self.merge_size * self.merge_size)
    }

    /// `(T, H, W)` positions of every token of one sequence whose images (in order) have
    /// `grids`, and `rope_delta = max position + 1 − length`.
    pub fn rope_index(&self, ids: &[u32], grids: &[[usize; 3]]) -> Result<(Vec<[u32; 3]>, i64)> {
        self.check_counts(ids, grids)?;
        if ids.contains(&self.video_token_id) {
            return Err(ModelError::InvalidInput(
                "video inputs are not supported yet (found a <|video_pad|> token)".into(),
            ));
        }
        let m = self.merge_size;
        let mut positions = Vec::with_capacity(ids.len());
        let mut cur = 0u32;
        let mut i = 0;
        let mut next_image = grids.iter();
        while i < ids.len() {
            if ids[i] != self.image_token_id {
                positions.push([cur; 3]);
                cur += 1;
                i += 1;
                continue;
            }
            let &[t, h, w] = next_image
                .next()
                .ok_or_else(|| ModelError::InvalidInput("more image tokens than images".into()))?;
            for tt in 0..t {
                for r in 0..h / m {
                    for c in 0..w / m {
                        positions.push([cur + tt as u32, cur + r as u32, cur + c as u32]);
                    }
                }
            }
            i += self.tokens_of([t, h, w]);
            cur += (h.max(w) / m) as u32;
        }
        let max = positions
            .iter()
            .flatten()
            .copied()
            .max()
            .map_or(0, i64::from);
        Ok((positions, max + 1 - ids.len() as i64))
    }

    /// Positions of `prompt` followed by `continuation` generated tokens: the prompt's from
    /// [`VisionTokens::rope_index`], the continuation's plain text positions after it (what
    /// decoding gives them; an image pad the policy generates is just text).
    pub fn sequence_positions(
        &self,
        prompt: &[u32],
        continuation: usize,
        grids: &[[usize; 3]],
    ) -> Result<Vec<[u32; 3]>> {
        let (mut positions, delta) = self.rope_index(prompt, grids)?;
        let start = prompt.len() as i64 + delta;
        positions.extend((start..start + continuation as i64).map(|p| [p as u32; 3]));
        Ok(positions)
    }

    /// Checks that the image tokens come in runs of exactly each image's token count.
    fn check_counts(&self, ids: &[u32], grids: &[[usize; 3]]) -> Result<()> {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < ids.len() {
            if ids[i] == self.image_token_id {
                let start = i;
                while i < ids.len() && ids[i] == self.image_token_id {
                    i += 1;
                }
                runs.push(i - start);
            } else {
                i += 1;
            }
        }
        let want: Vec<usize> = grids.iter().map(|&g| self.tokens_of(g)).collect();
        // Two images may sit side by side without text between them: compare the totals run
        // by run as the images fill them.
        let mut images = want.iter();
        for run in &runs {
            let mut filled = 0;
            while filled < *run {
                match images.next() {
                    Some(n) => filled += n,
                    None => break,
                }
            }
            if filled != *run {
                return Err(self.count_error(ids, &want));
            }
        }
        if images.next().is_some() {
            return Err(self.count_error(ids, &want));
        }
        Ok(())
    }

    fn count_error(&self, ids: &[u32], want: &[usize]) -> ModelError {
        let have = ids.iter().filter(|&&t| t == self.image_token_id).count();
        ModelError::InvalidInput(format!(
            "the prompt has {have} image tokens (id {}), but its {} images need {} ({want:?})",
            self.image_token_id,
            want.len(),
            want.iter().sum::<usize>()
        ))
    }

    /// Prompt ids with each image as a single `<|image_pad|>` (the chat template's output, and
    /// the compact form of the `score` contract) turned into the image's full run of pads.
    /// Ids whose pads already equal the images' token counts are returned unchanged.
    pub fn expand_image_pads(&self, ids: &[u32], grids: &[[usize; 3]]) -> Result<Vec<u32>> {
        let pads = ids.iter().filter(|&&t| t == self.image_token_id).count();
        let want: usize = grids.iter().map(|&g| self.tokens_of(g)).sum();
        if pads == want {
            self.check_counts(ids, grids)?;
            return Ok(ids.to_vec());
        }
        if pads != grids.len() {
            return Err(self.count_error(
                ids,
                &grids.iter().map(|&g| self.tokens_of(g)).collect::<Vec<_>>(),
            ));
        }
        let mut out = Vec::with_capacity(ids.len() + want - pads);
        let mut next = grids.iter();
        for &t in ids {
            match (t == self.image_token_id).then(|| next.next()).flatten() {
                Some(&g) => out.extend(std::iter::repeat_n(t, self.tokens_of(g))),
                None => out.push(t),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKENS: VisionTokens = VisionTokens {
        image_token_id: 9,
        video_token_id: 8,
        vision_start_token_id: 6,
        vision_end_token_id: 7,
        merge_size: 2,
    };

    #[test]
    fn the_spec_worked_example() {
        // 4 text tokens, a [1, 20, 14] image (70 tokens), then text from 4 + max(20, 14)/2 = 14.
        let mut ids = vec![1, 2, 3, 6];
        ids.extend([9; 70]);
        ids.extend([7, 5]);
        let (pos, delta) = TOKENS.rope_index(&ids, &[[1, 20, 14]]).unwrap();
        assert_eq!(pos[..4], [[0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 3, 3]]);
        assert_eq!(pos[4], [4, 4, 4]);
        assert_eq!(pos[4 + 6], [4, 4, 10]); // row 0, column 6
        assert_eq!(pos[4 + 7], [4, 5, 4]); // row 1, column 0
        assert_eq!(pos[4 + 69], [4, 13, 10]);
        assert_eq!(pos[74], [14, 14, 14]);
        assert_eq!(pos[75], [15, 15, 15]);
        // max 15 + 1 − 76 tokens.
        assert_eq!(delta, 16 - 76);
    }

    #[test]
    fn text_only_positions_are_plain_and_delta_zero() {
        let (pos, delta) = TOKENS.rope_index(&[1, 2, 3], &[]).unwrap();
        assert_eq!(pos, vec![[0; 3], [1; 3], [2; 3]]);
        assert_eq!(delta, 0);
    }

    #[test]
    fn pads_expand_to_each_images_count_and_mismatches_are_errors() {
        let ids = [1, 6, 9, 7, 2, 6, 9, 7];
        let out = TOKENS
            .expand_image_pads(&ids, &[[1, 4, 6], [1, 2, 2]])
            .unwrap();
        assert_eq!(out.len(), 8 - 2 + 6 + 1);
        assert_eq!(out.iter().filter(|&&t| t == 9).count(), 7);
        assert_eq!(
            TOKENS
                .expand_image_pads(&out, &[[1, 4, 6], [1, 2, 2]])
                .unwrap(),
            out
        );
        let e = TOKENS
            .expand_image_pads(&ids, &[[1, 4, 6]])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("2 image tokens") && e.contains("1 images"),
            "{e}"
        );
        assert!(TOKENS.rope_index(&out, &[[1, 2, 2], [1, 4, 6]]).is_err());
    }
}

import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';

/** The repository's root: this file runs as js/build/test/test/fixtures.js (tsconfig.test.json). */
const REPO = resolve(__dirname, '..', '..', '..', '..');

/** A JSON file of the Python tests' fixtures (tests/fixtures/). */
export function readFixture<T>(name: string): T {
  return JSON.parse(
    readFileSync(resolve(REPO, 'tests', 'fixtures', name), 'utf-8')
  ) as T;
}

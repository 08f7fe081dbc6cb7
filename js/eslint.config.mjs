// ESLint (flat config) for the extension's TypeScript: ESLint's and typescript-eslint's recommended
// rules, with type information (tsconfig.json for src/, tsconfig.test.json for test/).
import js from '@eslint/js';
import { defineConfig } from 'eslint/config';
import tseslint from 'typescript-eslint';

export default defineConfig(
  { ignores: ['lib/', 'build/', 'node_modules/', 'style/', '*.config.mjs'] },
  js.configs.recommended,
  tseslint.configs.recommendedTypeChecked,
  {
    languageOptions: {
      parserOptions: {
        project: ['./tsconfig.json', './tsconfig.test.json'],
        tsconfigRootDir: import.meta.dirname
      }
    },
    rules: {
      eqeqeq: 'error',
      curly: 'error',
      'prefer-const': 'error',
      '@typescript-eslint/naming-convention': [
        'error',
        { selector: 'interface', format: ['PascalCase'], prefix: ['I'] }
      ],
      // node:test's describe() and it() return promises the runner itself awaits.
      '@typescript-eslint/no-floating-promises': [
        'error',
        {
          allowForKnownSafeCalls: [
            { from: 'package', name: ['describe', 'it'], package: 'node:test' }
          ]
        }
      ],
      // Lumino's signal.connect(this._onX, this) binds the method through its thisArg.
      '@typescript-eslint/unbound-method': 'off',
      '@typescript-eslint/no-unused-vars': [
        'error',
        { args: 'none', caughtErrors: 'none' }
      ]
    }
  }
);
